//! Which launcher started this process, and what it says about this rank: reads the variables
//! of torchrun-style launchers (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`; also what `parc run --nproc-per-node` sets for its ranks),
//! Open MPI (`OMPI_COMM_WORLD_*`), PMI (`PMI_RANK`, `PMI_SIZE`, MPICH's `MPI_LOCALRANKID`) and
//! Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the first host of the step's or job's
//! nodelist as the rendezvous master, with Slurm's compact `node[01-04,07]` syntax expanded).
//!
//! Detection works on a plain map of variables so every launcher is testable without being
//! one; [`detect_process`] reads this process's environment.
//!
//! Precedence, most explicit first: torchrun-style, Open MPI, Slurm, PMI. `MASTER_ADDR` /
//! `MASTER_PORT` override the derived rendezvous address under every launcher. Torchrun-style
//! variables beside another launcher's that say another rank or world are refused (a `RANK`
//! left in the environment of an `mpirun` or `srun` job).
//!
//! Slurm's variables in a job's batch script (`SLURM_JOB_ID` but no step id: srun did not
//! start the process) make no rank; [`slurm_batch_script_of_tasks`] says why a plain run there
//! is refused.
use crate::error::{Result, RuntimeError};
use std::collections::HashMap;

/// The rendezvous port when nothing names one (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The launcher whose variables described this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LauncherKind {
    /// `RANK` / `WORLD_SIZE` (torchrun, Kubernetes operators, `parc run --nproc-per-node`).
    Torchrun,
    /// Open MPI's `mpirun` / `mpiexec` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// A PMI process manager (MPICH's hydra, `srun --mpi=pmi2`): `PMI_RANK` / `PMI_SIZE`.
    Pmi,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`).
    Slurm,
}

impl LauncherKind {
    pub fn name(self) -> &'static str {
        match self {
            LauncherKind::Torchrun => "torchrun-style env (RANK/WORLD_SIZE)",
            LauncherKind::OpenMpi => "Open MPI (OMPI_COMM_WORLD_*)",
            LauncherKind::Pmi => "PMI (PMI_RANK/PMI_SIZE)",
            LauncherKind::Slurm => "Slurm (SLURM_PROCID/SLURM_NTASKS)",
        }
    }
}

/// This process's place in a multi-process job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub kind: LauncherKind,
    /// Global rank of this process.
    pub rank: u32,
    /// Processes in the job.
    pub world: u32,
    /// Rank among the processes on this host: its GPU ordinal.
    pub local_rank: u32,
    /// Processes on this host, when the launcher says.
    pub local_world: Option<u32>,
    /// Host of the rendezvous (rank 0 listens there).
    pub master_addr: String,
    pub master_port: u16,
}

/// Variables as a map (tests build one; [`detect_process`] reads the real environment).
pub type EnvMap = HashMap<String, String>;

/// Read this process's environment.
pub fn detect_process() -> Result<Option<LaunchEnv>> {
    let env: EnvMap = std::env::vars().collect();
    detect(&env)
}

fn launch_error(message: String) -> RuntimeError {
    RuntimeError::Unsupported(format!("launch environment: {message}"))
}

fn number(env: &EnvMap, name: &str) -> Result<Option<u32>> {
    match env.get(name).map(|v| v.trim()) {
        None | Some("") => Ok(None),
        Some(v) => v
            .parse::<u32>()
            .map(Some)
            .map_err(|_| launch_error(format!("{name}={v:?} is not a non-negative whole number"))),
    }
}

fn required(env: &EnvMap, name: &str, kind: LauncherKind) -> Result<u32> {
    number(env, name)?.ok_or_else(|| {
        launch_error(format!(
            "{} is set but {name} is missing; set it or unset the launcher's other variables",
            kind.name()
        ))
    })
}

/// The first variable of `names` that is set (and its name).
fn first_set<'a>(env: &'a EnvMap, names: &[&'static str]) -> Option<(&'static str, &'a str)> {
    names.iter().find_map(|name| {
        env.get(*name)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty())
            .map(|v| (*name, v))
    })
}

/// Describe this process from `env`; `None` when no launcher variables are set (a plain,
/// single-process run).
pub fn detect(env: &EnvMap) -> Result<Option<LaunchEnv>> {
    let kind = if env.contains_key("RANK") || env.contains_key("WORLD_SIZE") {
        LauncherKind::Torchrun
    } else if env.contains_key("OMPI_COMM_WORLD_RANK") {
        LauncherKind::OpenMpi
    } else if env.contains_key("SLURM_PROCID") && !slurm_batch_script(env) {
        LauncherKind::Slurm
    } else if env.contains_key("PMI_RANK") {
        LauncherKind::Pmi
    } else {
        return Ok(None);
    };
    let (rank, world, local_rank, local_world) = match kind {
        LauncherKind::Torchrun => (
            required(env, "RANK", kind)?,
            required(env, "WORLD_SIZE", kind)?,
            number(env, "LOCAL_RANK")?,
            number(env, "LOCAL_WORLD_SIZE")?,
        ),
        LauncherKind::OpenMpi => (
            required(env, "OMPI_COMM_WORLD_RANK", kind)?,
            required(env, "OMPI_COMM_WORLD_SIZE", kind)?,
            number(env, "OMPI_COMM_WORLD_LOCAL_RANK")?,
            number(env, "OMPI_COMM_WORLD_LOCAL_SIZE")?,
        ),
        LauncherKind::Slurm => (
            required(env, "SLURM_PROCID", kind)?,
            required(env, "SLURM_NTASKS", kind)?,
            number(env, "SLURM_LOCALID")?,
            slurm_tasks_on_node(env)?,
        ),
        LauncherKind::Pmi => (
            required(env, "PMI_RANK", kind)?,
            required(env, "PMI_SIZE", kind)?,
            match number(env, "MPI_LOCALRANKID")? {
                Some(local) => Some(local),
                None => number(env, "PMI_LOCAL_RANK")?,
            },
            match number(env, "MPI_LOCALNRANKS")? {
                Some(n) => Some(n),
                None => number(env, "PMI_LOCAL_SIZE")?,
            },
        ),
    };
    if kind == LauncherKind::Torchrun {
        check_no_other_launcher(env, rank, world)?;
    }
    if world == 0 {
        return Err(launch_error(format!(
            "{} says the job has 0 processes",
            kind.name()
        )));
    }
    if rank >= world {
        return Err(launch_error(format!(
            "{} says this is rank {rank} of {world} processes; ranks are 0 to {}",
            kind.name(),
            world - 1
        )));
    }
    // LOCAL_RANK may be absent for a one-process-per-host job: then it is 0 there; with
    // several processes per host it must be given, or two ranks would share a GPU.
    let local_rank = match (local_rank, local_world) {
        (Some(local), _) => local,
        (None, Some(1)) => 0,
        (None, _) if world == 1 => 0,
        (None, _) => {
            return Err(launch_error(format!(
                "{} gives no local rank for rank {rank} of {world}; set {} (the process's \
                 index on its host, which picks its GPU)",
                kind.name(),
                local_rank_variable(kind)
            )))
        }
    };
    let (master_addr, master_port) = master(env, kind, world)?;
    Ok(Some(LaunchEnv {
        kind,
        rank,
        world,
        local_rank,
        local_world,
        master_addr,
        master_port,
    }))
}

/// The rank and world variables of the launchers that torchrun-style variables can hide.
const OTHER_LAUNCHERS: [(LauncherKind, &str, &str); 3] = [
    (
        LauncherKind::OpenMpi,
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
    ),
    (LauncherKind::Slurm, "SLURM_PROCID", "SLURM_NTASKS"),
    (LauncherKind::Pmi, "PMI_RANK", "PMI_SIZE"),
];

/// Refuse torchrun-style `RANK`/`WORLD_SIZE` (read first) beside another launcher's variables
/// that say otherwise. A `RANK` left in the environment (a shell's export, `mpirun -x`, `sbatch`
/// copying the submitting shell's variables) would make every process of an `mpirun` or `srun`
/// job the same rank, and the job fail later on a misleading port in use. A torchrun nested in
/// one task of the other launcher (`srun … torchrun`, which sets `TORCHELASTIC_RUN_ID`) is
/// meant, and so is another launcher's world of one process (`srun -n 1 parc run
/// --nproc-per-node N`).
fn check_no_other_launcher(env: &EnvMap, rank: u32, world: u32) -> Result<()> {
    if first_set(env, &["TORCHELASTIC_RUN_ID", "GROUP_RANK"]).is_some() {
        return Ok(());
    }
    for (kind, rank_var, size_var) in OTHER_LAUNCHERS {
        if kind == LauncherKind::Slurm && slurm_batch_script(env) {
            continue;
        }
        let read = |name: &str| number(env, name).ok().flatten();
        let (Some(their_rank), Some(their_world)) = (read(rank_var), read(size_var)) else {
            continue;
        };
        if their_world <= 1 || (their_rank, their_world) == (rank, world) {
            continue;
        }
        return Err(launch_error(format!(
            "two launchers' variables are set and disagree: RANK={rank} WORLD_SIZE={world} \
             (torchrun-style) but {rank_var}={their_rank} {size_var}={their_world} ({}); parc \
             reads RANK and WORLD_SIZE first, so the processes of this job would not each get \
             their own rank. If {} started this job, unset RANK, WORLD_SIZE, LOCAL_RANK and \
             LOCAL_WORLD_SIZE (and MASTER_ADDR and MASTER_PORT if they came with them: a \
             leftover export, or the submitting shell's environment); if a torchrun-style \
             launcher did, unset {rank_var} and {size_var}",
            kind.name(),
            launcher_command(kind)
        )));
    }
    Ok(())
}

/// How a user starts a job under `kind`, for messages.
fn launcher_command(kind: LauncherKind) -> &'static str {
    match kind {
        LauncherKind::Torchrun => "torchrun (or parc run --nproc-per-node)",
        LauncherKind::OpenMpi => "mpirun",
        LauncherKind::Slurm => "srun",
        LauncherKind::Pmi => "mpiexec (or srun --mpi=pmi2)",
    }
}

/// Whether Slurm's variables are those of a job's batch script: `SLURM_JOB_ID` set but no step
/// id (slurmstepd gives the batch script none; srun's tasks have theirs), or one of the ids
/// from 0xfffffff0 that Slurm reserves for its batch and extern steps. There `SLURM_PROCID` is
/// 0 and `SLURM_NTASKS` counts the tasks srun would start, not processes that run.
fn slurm_batch_script(env: &EnvMap) -> bool {
    if first_set(env, &["SLURM_JOB_ID", "SLURM_JOBID"]).is_none() {
        return false;
    }
    match first_set(env, &["SLURM_STEP_ID", "SLURM_STEPID"]) {
        None => true,
        Some((_, id)) => id.parse::<u32>().is_ok_and(|id| id >= 0xffff_fff0),
    }
}

/// Why a run in this process would be a mistake although no launcher started it: it runs the
/// batch script of a Slurm job of several tasks, whose ranks `srun` starts. (Its variables do
/// not make it a rank, [`detect`]; `--nproc-per-node` still starts ranks from it.)
pub fn slurm_batch_script_of_tasks(env: &EnvMap) -> Option<String> {
    if !slurm_batch_script(env) {
        return None;
    }
    let tasks = number(env, "SLURM_NTASKS")
        .ok()
        .flatten()
        .filter(|&n| n > 1)?;
    let job = first_set(env, &["SLURM_JOB_ID", "SLURM_JOBID"]).map_or("", |(_, v)| v);
    Some(format!(
        "launch environment: this process runs the batch script of Slurm job {job} \
         (SLURM_JOB_ID is set but SLURM_STEP_ID is not: srun did not start it), and \
         SLURM_NTASKS={tasks} counts the tasks srun would start, not processes that run; launch \
         one rank per task with `srun parc run …` in the script, or start the ranks on this host \
         with `parc run … --nproc-per-node N`, or run every rank in this one process with \
         `srun --ntasks=1 parc run …`"
    ))
}

/// Read this process's environment for [`slurm_batch_script_of_tasks`].
pub fn slurm_batch_script_of_tasks_here() -> Option<String> {
    let env: EnvMap = std::env::vars().collect();
    slurm_batch_script_of_tasks(&env)
}

/// The variable that gives `kind`'s local rank (the one [`detect`] reads first).
fn local_rank_variable(kind: LauncherKind) -> &'static str {
    match kind {
        LauncherKind::Torchrun => "LOCAL_RANK",
        LauncherKind::OpenMpi => "OMPI_COMM_WORLD_LOCAL_RANK",
        LauncherKind::Slurm => "SLURM_LOCALID",
        LauncherKind::Pmi => "MPI_LOCALRANKID",
    }
}

/// Slurm's tasks on this node: `SLURM_NTASKS_PER_NODE` when uniform, else absent.
fn slurm_tasks_on_node(env: &EnvMap) -> Result<Option<u32>> {
    match env.get("SLURM_NTASKS_PER_NODE").map(|v| v.trim()) {
        // Slurm writes non-uniform counts as `2(x3),1`; only a plain number is one count.
        Some(v) if v.chars().all(|c| c.is_ascii_digit()) && !v.is_empty() => {
            number(env, "SLURM_NTASKS_PER_NODE")
        }
        _ => Ok(None),
    }
}

/// Where rank 0 listens: `MASTER_ADDR` / `MASTER_PORT` when set, else what the launcher
/// implies.
fn master(env: &EnvMap, kind: LauncherKind, world: u32) -> Result<(String, u16)> {
    let port = match env.get("MASTER_PORT").map(|v| v.trim()) {
        Some(v) if !v.is_empty() => v.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(|| {
            // Port 0 would make rank 0 listen on a port the kernel picks, which no other rank
            // knows: they would retry until the rendezvous timeout.
            launch_error(format!("MASTER_PORT={v:?} is not a port number (1-65535)"))
        })?,
        _ => job_port(env, kind)?,
    };
    if let Some(addr) = env
        .get("MASTER_ADDR")
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
    {
        return Ok((addr.to_string(), port));
    }
    let addr = match kind {
        LauncherKind::Slurm => {
            let (name, list) = first_set(
                env,
                &[
                    "SLURM_STEP_NODELIST",
                    "SLURM_JOB_NODELIST",
                    "SLURM_NODELIST",
                ],
            )
            .ok_or_else(|| {
                launch_error(
                    "Slurm gives no nodelist (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or \
                     SLURM_NODELIST); set MASTER_ADDR to the host of rank 0"
                        .to_string(),
                )
            })?;
            let hosts =
                expand_nodelist(list).map_err(|e| launch_error(format!("{name}={list:?}: {e}")))?;
            hosts.into_iter().next().ok_or_else(|| {
                launch_error(format!("{name}={list:?} names no host; set MASTER_ADDR"))
            })?
        }
        LauncherKind::OpenMpi | LauncherKind::Pmi => {
            // All processes on this host: the rendezvous is local.
            let local = match kind {
                LauncherKind::OpenMpi => number(env, "OMPI_COMM_WORLD_LOCAL_SIZE")?,
                _ => match number(env, "MPI_LOCALNRANKS")? {
                    Some(n) => Some(n),
                    None => number(env, "PMI_LOCAL_SIZE")?,
                },
            };
            if local == Some(world) || world == 1 {
                "127.0.0.1".to_string()
            } else {
                return Err(launch_error(format!(
                    "{} spans several hosts but MASTER_ADDR is not set; pass the host of rank \
                     0, e.g. `mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT={port} …`",
                    kind.name()
                )));
            }
        }
        LauncherKind::Torchrun => {
            if world == 1 {
                "127.0.0.1".to_string()
            } else {
                return Err(launch_error(
                    "RANK/WORLD_SIZE are set but MASTER_ADDR is not; set MASTER_ADDR (the host \
                     of rank 0) and MASTER_PORT"
                        .to_string(),
                ));
            }
        }
    };
    Ok((addr, port))
}

/// The rendezvous port without `MASTER_PORT`: one per job where the launcher names the job
/// (Slurm's job and step, the PMIx namespace of `mpirun` and `srun --mpi=pmix`), so two jobs
/// sharing a host do not meet; else [`DEFAULT_MASTER_PORT`].
fn job_port(env: &EnvMap, kind: LauncherKind) -> Result<u16> {
    let job = match kind {
        LauncherKind::Torchrun => None,
        LauncherKind::Slurm => match number(env, "SLURM_JOB_ID")? {
            Some(job) => Some(format!(
                "{job}.{}",
                number(env, "SLURM_STEP_ID")?.unwrap_or(0)
            )),
            None => None,
        },
        LauncherKind::OpenMpi | LauncherKind::Pmi => env
            .get("PMIX_NAMESPACE")
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty()),
    };
    Ok(match job {
        Some(job) => {
            let hash = crate::fnv::fnv1a(job.as_bytes());
            // Below Linux's ephemeral range (32768-60999), which outgoing connections use.
            20000 + (hash % 12768) as u16
        }
        None => DEFAULT_MASTER_PORT,
    })
}

/// Expand Slurm's compact hostlist: `node[01-04,07],gpu-a[1-2]-ib` →
/// `node01 node02 node03 node04 node07 gpu-a1-ib gpu-a2-ib`. Ranges keep the zero padding of
/// their start; several bracket groups in one name expand as a product.
pub fn expand_nodelist(list: &str) -> std::result::Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        expand_name(item, &mut hosts)?;
    }
    Ok(hosts)
}

/// Split at commas outside brackets.
fn split_top_level(list: &str) -> std::result::Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0u32, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => {
                depth = depth
                    .checked_sub(1)
                    .ok_or_else(|| format!("unmatched `]` at byte {i}"))?
            }
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unclosed `[`".to_string());
    }
    items.push(&list[start..]);
    Ok(items)
}

/// Expand the first bracket group of `name` and recurse on the rest.
fn expand_name(name: &str, out: &mut Vec<String>) -> std::result::Result<(), String> {
    let Some(open) = name.find('[') else {
        out.push(name.to_string());
        return Ok(());
    };
    let close = name[open..]
        .find(']')
        .map(|i| open + i)
        .ok_or_else(|| format!("unclosed `[` in {name:?}"))?;
    let (prefix, body, suffix) = (&name[..open], &name[open + 1..close], &name[close + 1..]);
    for part in body.split(',') {
        let part = part.trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let parse = |s: &str| {
            s.parse::<u64>()
                .map_err(|_| format!("{part:?} in {name:?} is not a number or a range a-b"))
        };
        let (start, end) = (parse(lo)?, parse(hi)?);
        if end < start {
            return Err(format!("range {part:?} in {name:?} runs backwards"));
        }
        if end - start > 100_000 {
            return Err(format!("range {part:?} in {name:?} is too large"));
        }
        let width = lo.len();
        for n in start..=end {
            expand_name(&format!("{prefix}{n:0width$}{suffix}"), out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> EnvMap {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Open MPI's variables for `ids` (rank, world size, local rank, local size), then `extra`.
    fn open_mpi(ids: [&str; 4], extra: &[(&str, &str)]) -> EnvMap {
        let names = [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ];
        let mut pairs: Vec<(&str, &str)> = names.into_iter().zip(ids).collect();
        pairs.extend(extra);
        env(&pairs)
    }

    #[test]
    fn no_launcher_variables_is_a_single_process_run() {
        assert_eq!(detect(&env(&[("HOME", "/root")])).unwrap(), None);
    }

    #[test]
    fn torchrun_style_env() {
        let e = detect(&env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "trainer-0.trainer"),
            ("MASTER_PORT", "23456"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                kind: LauncherKind::Torchrun,
                rank: 5,
                world: 8,
                local_rank: 1,
                local_world: Some(4),
                master_addr: "trainer-0.trainer".into(),
                master_port: 23456,
            }
        );
        let err = detect(&env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("MASTER_ADDR is not"), "{err}");
        let err = detect(&env(&[("RANK", "2"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 2 of 2 processes"), "{err}");
        let err = detect(&env(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("RANK=\"x\""), "{err}");
        let err = detect(&env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("set LOCAL_RANK"), "{err}");
    }

    #[test]
    fn open_mpi_env_on_one_host_meets_locally() {
        let e = detect(&open_mpi(["3", "4", "3", "4"], &[]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (e.kind, e.rank, e.world, e.local_rank, e.local_world),
            (LauncherKind::OpenMpi, 3, 4, 3, Some(4))
        );
        assert_eq!(
            (e.master_addr.as_str(), e.master_port),
            ("127.0.0.1", 29500)
        );
        // Under mpirun (PMIx), one port per job.
        let port = |ns: &str| {
            let pmix = open_mpi(["0", "2", "0", "2"], &[("PMIX_NAMESPACE", ns)]);
            detect(&pmix).unwrap().unwrap().master_port
        };
        assert_ne!(port("574423041"), port("574423042"));
        assert!((20000..32768).contains(&port("574423041")));
        let err = detect(&open_mpi(["3", "16", "3", "8"], &[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("mpirun -x MASTER_ADDR"), "{err}");
    }

    #[test]
    fn pmi_env_uses_mpich_local_rank() {
        let e = detect(&env(&[
            ("PMI_RANK", "6"),
            ("PMI_SIZE", "8"),
            ("MPI_LOCALRANKID", "2"),
            ("MPI_LOCALNRANKS", "4"),
            ("MASTER_ADDR", "n0"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.kind, e.rank, e.world, e.local_rank, e.local_world),
            (LauncherKind::Pmi, 6, 8, 2, Some(4))
        );
        assert_eq!(e.master_addr, "n0");
    }

    #[test]
    fn slurm_env_takes_the_first_host_of_the_nodelist() {
        let e = detect(&env(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "8"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_ID", "0"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                kind: LauncherKind::Slurm,
                rank: 9,
                world: 16,
                local_rank: 1,
                local_world: Some(8),
                master_addr: "gpu07".into(),
                master_port: job_port(&env(&[("SLURM_JOB_ID", "123456")]), LauncherKind::Slurm)
                    .unwrap(),
            }
        );
        // Non-uniform task counts are not one number; the step's nodelist wins over the job's.
        let e = detect(&env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "3"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NTASKS_PER_NODE", "2(x1),1"),
            ("SLURM_STEP_NODELIST", "b[3-4]"),
            ("SLURM_JOB_NODELIST", "a[1-9]"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((e.local_world, e.master_addr.as_str()), (None, "b3"));
        // Open MPI under a Slurm allocation is Open MPI's rank.
        let slurm = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")];
        let e = detect(&open_mpi(["2", "4", "2", "4"], &slurm))
            .unwrap()
            .unwrap();
        assert_eq!((e.kind, e.rank), (LauncherKind::OpenMpi, 2));
        let err = detect(&env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("set MASTER_ADDR"), "{err}");
        // Several tasks per node and no SLURM_LOCALID: the advice names Slurm's variable
        // (LOCAL_RANK is not read under Slurm).
        let err = detect(&env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_JOB_NODELIST", "a1"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("set SLURM_LOCALID"), "{err}");
    }

    #[test]
    fn a_rank_variable_beside_another_launchers_that_disagree_is_refused() {
        let leftover = [
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "old-host"),
        ];
        // mpirun's rank 2 of 4 with a RANK left from elsewhere: every process would say rank 0.
        let err = detect(&open_mpi(["2", "4", "2", "4"], &leftover))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("RANK=0 WORLD_SIZE=4 (torchrun-style)")
                && err.contains("OMPI_COMM_WORLD_RANK=2 OMPI_COMM_WORLD_SIZE=4")
                && err.contains("If mpirun started this job, unset RANK, WORLD_SIZE"),
            "{err}"
        );
        let mut pmi = env(&[("PMI_RANK", "3"), ("PMI_SIZE", "8")]);
        pmi.extend(env(&leftover));
        let err = detect(&pmi).unwrap_err().to_string();
        assert!(err.contains("PMI_RANK=3 PMI_SIZE=8"), "{err}");
        let mut srun = env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "4")]);
        srun.extend(env(&[("SLURM_JOB_ID", "9"), ("SLURM_STEP_ID", "0")]));
        srun.extend(env(&leftover));
        let err = detect(&srun).unwrap_err().to_string();
        assert!(err.contains("If srun started this job"), "{err}");
        // Agreeing variables (a wrapper's `RANK=$OMPI_COMM_WORLD_RANK`) are one launch.
        let agree = [
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("MASTER_ADDR", "h"),
        ];
        let e = detect(&open_mpi(["2", "4", "2", "4"], &agree))
            .unwrap()
            .unwrap();
        assert_eq!((e.kind, e.rank), (LauncherKind::Torchrun, 2));
        // torchrun in one task of srun or mpirun; parc's launcher in a one-task step.
        let mut nested = srun.clone();
        nested.insert("TORCHELASTIC_RUN_ID".into(), "job".into());
        assert_eq!(detect(&nested).unwrap().unwrap().rank, 0);
        let one_task = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")];
        let mut launched = env(&leftover);
        launched.extend(env(&one_task));
        assert_eq!(detect(&launched).unwrap().unwrap().world, 4);
    }

    #[test]
    fn a_slurm_batch_script_is_no_rank_and_says_to_launch_with_srun() {
        // sbatch's script: job id, the allocation's task count, SLURM_PROCID=0, no step id.
        let batch = env(&[
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "gpu[01-02]"),
        ]);
        assert_eq!(detect(&batch).unwrap(), None);
        let why = slurm_batch_script_of_tasks(&batch).unwrap();
        assert!(
            why.contains("batch script of Slurm job 4242")
                && why.contains("SLURM_NTASKS=16")
                && why.contains("`srun parc run …`"),
            "{why}"
        );
        // The batch step's reserved id is the batch script too; srun's task is a rank.
        let mut reserved = batch.clone();
        reserved.insert("SLURM_STEP_ID".into(), "4294967291".into());
        assert!(slurm_batch_script_of_tasks(&reserved).is_some());
        let mut task = batch.clone();
        task.insert("SLURM_STEP_ID".into(), "0".into());
        assert_eq!(detect(&task).unwrap().unwrap().world, 16);
        assert_eq!(slurm_batch_script_of_tasks(&task), None);
        // One task: a plain run; parc's launcher's ranks under the script are torchrun's.
        let mut one = batch.clone();
        one.insert("SLURM_NTASKS".into(), "1".into());
        assert_eq!(slurm_batch_script_of_tasks(&one), None);
        let mut rank = batch;
        for (key, value) in [("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "3")] {
            rank.insert(key.into(), value.into());
        }
        rank.insert("MASTER_ADDR".into(), "127.0.0.1".into());
        assert_eq!(detect(&rank).unwrap().unwrap().rank, 3);
    }

    #[test]
    fn master_port_zero_is_refused() {
        // Rank 0 would listen where the kernel picks, which no other rank knows.
        let err = detect(&env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "0"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("MASTER_PORT=\"0\" is not a port number"),
            "{err}"
        );
    }

    #[test]
    fn nodelists_expand_ranges_padding_products_and_plain_names() {
        assert_eq!(
            expand_nodelist("node[01-04,07]").unwrap(),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(
            expand_nodelist("login,gpu-a[8-10]-ib").unwrap(),
            ["login", "gpu-a8-ib", "gpu-a9-ib", "gpu-a10-ib"]
        );
        assert_eq!(
            expand_nodelist("r[1-2]n[0-1],x").unwrap(),
            ["r1n0", "r1n1", "r2n0", "r2n1", "x"]
        );
        assert!(expand_nodelist("n[1-").unwrap_err().contains("unclosed"));
        assert!(expand_nodelist("n[4-2]").unwrap_err().contains("backwards"));
        assert!(expand_nodelist("n[a]")
            .unwrap_err()
            .contains("not a number"));
    }
}
