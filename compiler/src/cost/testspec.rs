//! Hand-built specs of any size for cost-model, verifier and timeline tests (the parser is not
//! needed): a GPT-2-style or Llama-style decoder ([`crate::testing::decoder_model`]) with the
//! given dimensions and plan, on H100s.

use crate::diag::Span;
use crate::spec::*;
use crate::testing;
pub use crate::testing::Dims;

#[derive(Clone, Debug)]
pub struct Plan {
    pub dp: u32,
    pub pp: u32,
    pub cp: u32,
    pub tp: u32,
    pub zero: ZeroStage,
    pub schedule: PipelineSchedule,
    pub microbatches: u32,
    pub micro_batch: u64,
    pub recompute: Recompute,
    pub sp: bool,
    /// What sequence-parallel layers keep of their gathered input (`parallel.sp_save`).
    pub sp_save: SpSave,
    pub precision: Precision,
    pub gpus_per_node: u32,
    /// How the layers split over the pipeline's chunks; `layers` is the list for `Given`.
    pub balance: Balance,
    pub layers: Vec<u32>,
}

impl Default for Plan {
    fn default() -> Plan {
        Plan {
            dp: 1,
            pp: 1,
            cp: 1,
            tp: 1,
            zero: ZeroStage::Zero0,
            schedule: PipelineSchedule::OneFOneB,
            microbatches: 4,
            micro_batch: 2,
            recompute: Recompute::None,
            sp: false,
            sp_save: SpSave::Sharded,
            precision: Precision::Fp32,
            gpus_per_node: 8,
            balance: Balance::Even,
            layers: Vec::new(),
        }
    }
}

pub fn build(d: &Dims, plan: &Plan) -> Spec {
    let world = plan.dp * plan.pp * plan.cp * plan.tp;
    let gpn = plan.gpus_per_node.min(world).max(1);
    let mut spec = Spec {
        model: testing::decoder_model(d, "test", &plan.recompute, plan.tp, plan.cp),
        parallel: Parallel {
            mesh: Mesh {
                axes: vec![
                    (Axis::Dp, plan.dp),
                    (Axis::Pp, plan.pp),
                    (Axis::Cp, plan.cp),
                    (Axis::Tp, plan.tp),
                ],
            },
            zero: plan.zero,
            schedule: plan.schedule,
            microbatches: plan.microbatches,
            recompute: plan.recompute.clone(),
            sequence_parallel: plan.sp,
            sp_save: plan.sp_save,
            bucket_bytes: 25 << 20,
            balance: plan.balance,
            chunk_layers: plan.layers.clone(),
            cross_node: Vec::new(),
            span: Span::new(crate::diag::FileId(0), 10, 20),
        },
        train: testing::train(
            plan.micro_batch,
            plan.micro_batch * u64::from(plan.microbatches) * u64::from(plan.dp),
            plan.precision,
            testing::adamw(),
        ),
        cluster: Cluster {
            nodes: world.div_ceil(gpn),
            gpus_per_node: gpn,
            gpu: Gpu {
                name: "h100_80gb".into(),
                memory_bytes: 80 << 30,
                peak_flops: 989e12,
                peak_flops_fp32: 67e12,
                peak_flops_fp8: Some(1979e12),
                memory_bandwidth: 3.35e12,
            },
            intra: Link {
                kind: "nvlink".into(),
                bandwidth: 450e9,
                latency: 5e-6,
            },
            inter: Link {
                kind: "infiniband".into(),
                bandwidth: 50e9,
                latency: 1e-5,
            },
            span: Span::new(crate::diag::FileId(0), 30, 40),
        },
    };
    crate::cost::balance::rebalance(&mut spec);
    spec
}
