use super::*;

fn line(points: &[(f64, f64)]) -> Vec<(Vec<f64>, f64)> {
    points.iter().map(|&(x, r)| (vec![x], r)).collect()
}

#[test]
fn one_dimension_interpolates_linearly_in_log_size_and_clamps_outside() {
    let points = line(&[(10.0, 1.0), (20.0, 3.0), (30.0, 4.0)]);
    assert_eq!(rate_at(&points, &[15.0]), Some(2.0));
    assert_eq!(rate_at(&points, &[20.0]), Some(3.0));
    assert_eq!(rate_at(&points, &[25.0]), Some(3.5));
    // Outside the grid: the edge's rate, never extrapolated.
    assert_eq!(rate_at(&points, &[2.0]), Some(1.0));
    assert_eq!(rate_at(&points, &[40.0]), Some(4.0));
    assert_eq!(rate_at(&[], &[1.0]), None);
}

fn cube() -> Vec<(Vec<f64>, f64)> {
    let mut points = Vec::new();
    for (i, m) in [6.0, 10.0].into_iter().enumerate() {
        for (j, n) in [6.0, 10.0].into_iter().enumerate() {
            for (k, kk) in [6.0, 10.0].into_iter().enumerate() {
                points.push((vec![m, n, kk], 1e9 * (1 + i + 2 * j + 4 * k) as f64));
            }
        }
    }
    points
}

#[test]
fn more_dimensions_give_a_measured_point_its_rate_and_clamp_to_the_corner() {
    let points = cube();
    assert_eq!(rate_at(&points, &[10.0, 6.0, 10.0]), Some(6e9));
    // Beyond the largest corner in every dimension: that corner's rate.
    assert_eq!(rate_at(&points, &[14.0, 20.0, 11.0]), Some(8e9));
    assert_eq!(rate_at(&points, &[1.0, 1.0, 1.0]), Some(1e9));
}

#[test]
fn an_interpolated_rate_stays_between_the_rates_measured() {
    let points = cube();
    for at in [
        [8.0, 8.0, 8.0],
        [7.0, 9.5, 6.5],
        [12.0, 3.0, 8.0],
        [9.9, 9.9, 9.9],
    ] {
        let rate = rate_at(&points, &at).unwrap_or(0.0);
        assert!((1e9..=8e9).contains(&rate), "{at:?}: {rate}");
    }
    // Nearer the fast corner, faster.
    let near_fast = rate_at(&points, &[9.5, 9.5, 9.5]).unwrap_or(0.0);
    let near_slow = rate_at(&points, &[6.5, 6.5, 6.5]).unwrap_or(0.0);
    assert!(near_fast > near_slow);
}

pub(crate) fn sample() -> Profile {
    Profile {
        version: VERSION,
        gpu: "cpu".into(),
        device: "test".into(),
        backend: "cpu".into(),
        precision: "fp32".into(),
        date: "2026-01-01".into(),
        parc_version: "0".into(),
        peak_flops: 1e11,
        memory_bandwidth: 2e10,
        launch_overhead_s: 1e-6,
        gemm: vec![GemmPoint {
            layout: GemmLayout::Fwd,
            m: 64,
            n: 64,
            k: 64,
            dtype: "f32".into(),
            accumulate: false,
            bias: false,
            act: false,
            seconds: 1e-5,
        }],
        attention: vec![],
        memory: vec![MemoryPoint {
            kind: MemoryKind::Elementwise,
            bytes: 4096.0,
            op: None,
            cols: None,
            seconds: 1e-6,
        }],
        collectives: vec![],
        notes: vec![],
    }
}

fn json(profile: &Profile) -> String {
    serde_json::to_string(profile).unwrap_or_default()
}

#[test]
fn a_profile_reads_back_what_was_written() {
    let profile = sample();
    assert_eq!(Profile::parse(&json(&profile)), Ok(profile));
}

#[test]
fn bad_profiles_say_why() {
    let text = json(&sample());
    let truncated = Profile::parse(&text[..text.len() / 2]);
    assert!(matches!(
        truncated,
        Err(ProfileError::Json {
            truncated: true,
            ..
        })
    ));
    assert!(matches!(
        Profile::parse("{\"gemm\": 3"),
        Err(ProfileError::Json { .. })
    ));
    let other = text.replace(&format!("\"version\":{VERSION}"), "\"version\":7");
    assert_eq!(
        Profile::parse(&other),
        Err(ProfileError::Version { found: Some(7) })
    );
    let with_time = |seconds: f64| {
        let mut p = sample();
        p.gemm[0].seconds = seconds;
        json(&p)
    };
    assert!(matches!(
        Profile::parse(&with_time(-1.0)),
        Err(ProfileError::Invalid(_))
    ));
    assert!(matches!(
        Profile::parse(&with_time(0.0)),
        Err(ProfileError::Invalid(_))
    ));
    // NaN is written as null: refused as a value that is not a number.
    let err = Profile::parse(&with_time(f64::NAN))
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(err.contains("a time that is not a number"), "{err}");
}

#[test]
fn a_version_1_profile_reads_with_adam_w_counted_read_and_written() {
    let point = |op: &str, bytes: f64| MemoryPoint {
        kind: MemoryKind::Optimizer,
        bytes,
        op: Some(op.into()),
        cols: None,
        seconds: 1e-5,
    };
    let mut v1 = sample();
    v1.version = 1;
    v1.memory.push(point("adam_w", 16.0 * 2048.0));
    v1.memory.push(point("adam_w_multi", 16.0 * 4096.0));
    let read = Profile::parse(&json(&v1));
    let Ok(read) = read else {
        panic!("{read:?}");
    };
    assert_eq!(read.version, VERSION);
    let bytes: Vec<f64> = read.memory.iter().map(|p| p.bytes).collect();
    // The elementwise point unchanged; AdamW's 16 bytes a parameter now 28.
    assert_eq!(bytes, vec![4096.0, 28.0 * 2048.0, 28.0 * 4096.0]);
    // A version-1 SGD point cannot be converted (its momentum is unknown).
    v1.memory.push(point("sgd", 8.0 * 2048.0));
    assert_eq!(
        Profile::parse(&json(&v1)),
        Err(ProfileError::Version { found: Some(1) })
    );
}
