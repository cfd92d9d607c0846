//! Whether a resume trains on the data its checkpoint's run trained on (E1107). The manifest
//! records the samples the sampler drew from (`samples`: an epoch's length, which gives the
//! sampler's position its meaning) and, since this check exists, what the data was
//! (`data`: `crate::data::record`). Another file (other bytes, whatever its name), another
//! size or token count, another way of reading it (`as u16` / `as u32`, another tokenizer) or
//! another number of samples (another `seq`, another held-out evaluation tail) is a change;
//! `--resume-any-data` consents to it, and the sampler then continues on the new data at the
//! samples the checkpoint had seen.
use super::layout::Refusal;
use super::Manifest;
use crate::data::record::{DataRecord, FileRecord};

/// A resumed run's training data as it can be compared: its record (None where it could not be
/// read, e.g. `parc check` away from the data) and the samples training draws from (None where
/// they are not known without tokenizing).
#[derive(Clone, Copy, Debug)]
pub struct DataSeen<'a> {
    pub record: Option<&'a DataRecord>,
    pub samples: Option<u64>,
}

/// Why the checkpoint of `manifest` was trained on other data than `new`, or None when nothing
/// that can be compared differs. A checkpoint of an older build records only its samples.
pub fn data_change(manifest: &Manifest, new: DataSeen<'_>) -> Option<Refusal> {
    let old = manifest.data.as_ref();
    let what = old
        .zip(new.record)
        .and_then(|(old, new)| record_change(old, new));
    let what = what.or_else(|| {
        new.samples.filter(|&s| s != manifest.samples).map(|s| {
            format!(
                "the checkpoint's run drew from {} samples of seq + 1 tokens, this run's data \
                 gives {s} (a sample count follows from the data, `seq` and a held-out \
                 evaluation tail)",
                manifest.samples
            )
        })
    })?;
    let was = old.map_or_else(
        || "the data the checkpoint's run trained on".to_string(),
        |old| {
            format!(
                "the data the checkpoint's run trained on ({})",
                old.describe()
            )
        },
    );
    Some(Refusal {
        code: "E1107",
        field: "train.data",
        message: format!(
            "{what}: the sampler's position (samples seen, in epochs of the data's length) \
             would not continue the checkpoint's data order"
        ),
        help: format!(
            "resume with {was}, or let --resume-any-data continue on this data at the samples \
             the checkpoint had seen"
        ),
    })
}

/// The tokens of the data `record`: its own count, else (text that was not tokenized) the
/// count the checkpoint of `manifest` recorded for the same files read the same way.
pub fn known_tokens(manifest: &Manifest, record: &DataRecord) -> Option<u64> {
    record.tokens.or_else(|| {
        let old = manifest.data.as_ref()?;
        record_change(old, record).is_none().then_some(old.tokens)?
    })
}

/// What differs between the recorded data `old` and `new`, first difference first.
fn record_change(old: &DataRecord, new: &DataRecord) -> Option<String> {
    if old.reads != new.reads {
        return Some(format!(
            "the checkpoint's run read its data as {}, this run as {}",
            old.reads, new.reads
        ));
    }
    if old.files.len() != new.files.len() {
        return Some(format!(
            "the checkpoint's run read {}, this run reads {}",
            count_files(&old.files),
            count_files(&new.files)
        ));
    }
    let files = old.files.iter().zip(&new.files);
    if let Some(change) = files.filter_map(|(o, n)| file_change(o, n)).next() {
        return Some(change);
    }
    if let Some(change) = old.tokenizer.as_ref().zip(new.tokenizer.as_ref()) {
        if let Some(change) = file_change(change.0, change.1) {
            return Some(format!("its tokenizer: {change}"));
        }
    }
    match (old.tokens, new.tokens) {
        (Some(o), Some(n)) if o != n => Some(format!(
            "the checkpoint's run read {o} tokens, this run's data holds {n}"
        )),
        _ => None,
    }
}

fn count_files(files: &[FileRecord]) -> String {
    match files {
        [file] => file.path.clone(),
        _ => format!("{} files", files.len()),
    }
}

/// How file `new` differs from the file `old` the checkpoint's run read.
fn file_change(old: &FileRecord, new: &FileRecord) -> Option<String> {
    if old.bytes != new.bytes {
        return Some(format!(
            "{} has {} bytes, the file the checkpoint's run read ({}) had {}",
            new.path, new.bytes, old.path, old.bytes
        ));
    }
    (old.crc32c != new.crc32c).then(|| {
        format!(
            "{} holds other bytes than the file the checkpoint's run read ({}, of the same \
             size: CRC-32C {:08x} there, {:08x} here)",
            new.path, old.path, old.crc32c, new.crc32c
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::FORMAT;

    fn file(path: &str, bytes: u64, crc32c: u32) -> FileRecord {
        FileRecord {
            path: path.to_string(),
            bytes,
            crc32c,
        }
    }

    fn record(files: Vec<FileRecord>, tokens: Option<u64>) -> DataRecord {
        DataRecord {
            reads: "u16 token ids".to_string(),
            files,
            tokenizer: None,
            tokens,
        }
    }

    fn manifest(data: Option<DataRecord>) -> Manifest {
        Manifest {
            format: FORMAT,
            plan_hash: "aaaa".to_string(),
            world: 1,
            step: 4,
            optimizer_step: 4,
            seed: 0,
            samples: 50,
            samples_seen: None,
            loss_scale: None,
            shards: Vec::new(),
            checksums: Default::default(),
            layout: None,
            data,
        }
    }

    fn change(m: &Manifest, record: Option<&DataRecord>, samples: Option<u64>) -> Option<String> {
        data_change(m, DataSeen { record, samples }).map(|r| {
            assert_eq!((r.code, r.field), ("E1107", "train.data"));
            assert!(r.help.contains("--resume-any-data"), "{}", r.help);
            r.message
        })
    }

    #[test]
    fn the_same_bytes_anywhere_are_the_same_data_and_anything_else_is_named() {
        let old = record(vec![file("a/train.bin", 102, 7)], Some(51));
        let m = manifest(Some(old.clone()));
        let moved = record(vec![file("b/renamed.bin", 102, 7)], Some(51));
        assert_eq!(change(&m, Some(&moved), Some(50)), None);
        let other = record(vec![file("b/train.bin", 102, 8)], Some(51));
        let got = change(&m, Some(&other), Some(50)).unwrap();
        assert!(got.contains("b/train.bin holds other bytes") && got.contains("a/train.bin"));
        let longer = record(vec![file("a/train.bin", 202, 9)], Some(101));
        let got = change(&m, Some(&longer), Some(100)).unwrap();
        assert!(
            got.contains("has 202 bytes") && got.contains("had 102"),
            "{got}"
        );
        let two = record(vec![file("x", 51, 7), file("y", 51, 7)], Some(51));
        assert!(change(&m, Some(&two), Some(50))
            .unwrap()
            .contains("2 files"));
        let u32s = DataRecord {
            reads: "u32 token ids".to_string(),
            ..old.clone()
        };
        assert!(change(&m, Some(&u32s), Some(25))
            .unwrap()
            .contains("as u32"));
        // Another seq: the same files, other samples.
        let got = change(&m, Some(&old), Some(25)).unwrap();
        assert!(
            got.contains("50 samples") && got.contains("gives 25"),
            "{got}"
        );
    }

    #[test]
    fn uncounted_text_of_the_same_files_has_the_checkpoints_count_and_older_ones_compare_samples() {
        let text = |crc| DataRecord {
            reads: "text through gpt2".to_string(),
            ..record(vec![file("t.txt", 90, crc)], None)
        };
        let m = manifest(Some(text(1).counted(51)));
        assert_eq!(known_tokens(&m, &text(1)), Some(51));
        assert_eq!(known_tokens(&m, &text(2)), None);
        assert_eq!(change(&m, Some(&text(1)), None), None);
        assert!(change(&m, Some(&text(2)), None).is_some());
        let older = manifest(None);
        assert_eq!(known_tokens(&older, &text(1)), None);
        assert_eq!(change(&older, Some(&text(1)), None), None);
        assert_eq!(change(&older, None, Some(50)), None);
        let got = change(&older, None, Some(49)).unwrap();
        assert!(got.contains("gives 49"), "{got}");
    }
}
