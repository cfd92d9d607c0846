#!/usr/bin/env bash
# ncu (on the device machine: /usr/local/cuda/bin/ncu) of parc's wgmma attention kernels and of PyTorch
# SDPA's (cuDNN's, on the H200) at GPT-2 124M's shape, 32·12·1024·64 causal: duration, registers,
# occupancy, issue-slot use, L1/L2 hit rates, DRAM throughput (bench/RESULTS.md, session 6).
# Binaries from bench/device_build.sh (carry .device); output under $OUT/n.
set -u
cd "$(dirname "$0")/.."
source bench/device_env.sh
mkdir -p $OUT/n
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats"
PARC_ATT_POINT=32,12,1024,64 timeout 150 /usr/local/cuda/bin/ncu $S -k "regex:attention_(fwd|bwd)_wgmma_d64" -c 2 .device/cuda_attention_bench --ignored --nocapture > $OUT/n/parc.txt 2>&1
echo "parc rc=$?"
cat > /tmp/sdpa.py <<'PY'
import torch, torch.nn.functional as F
q = torch.randn(32, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn_like(q, requires_grad=True); v = torch.randn_like(q, requires_grad=True)
for _ in range(2):
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True); o.backward(torch.randn_like(o))
torch.cuda.synchronize()
PY
timeout 150 /usr/local/cuda/bin/ncu $S -k "regex:flash" -c 3 python3 /tmp/sdpa.py > $OUT/n/sdpa.txt 2>&1
echo "sdpa rc=$?"
for f in $OUT/n/*.txt; do echo "#### $f"; grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Block Size|Grid Size|Shared Memory Configuration|Dynamic Shared|Waves Per SM|L1/TEX Hit|L2 Hit|Executed Ipc A|Warp Cycles Per Issued|Stall|One or More" $f | head -90; done
