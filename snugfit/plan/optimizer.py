"""What an optimizer setup (Plan.optimizer) holds and costs per trainable element: the one table the memory and time
models read. Pure: no torch.

    master_weights  fp32: 4 bytes a weight; bf16: 2 (updated with stochastic rounding, no fp32 copy anywhere). The
                    gradient FSDP2 leaves in the shard has the weight's dtype.
    states          AdamW's two, per element: fp32 8 bytes, bf16 4; 8bit and 4bit are torchao 0.18's blockwise
                    quantized states: a code per element (1 byte, or half of one), an fp32 scale per block of 256
                    (128) elements and a lookup table of 256 (16) fp32 entries per tensor. torchao quantizes only a
                    tensor (its local shard) of at least 4096 elements that its block divides; the others keep plain
                    states in the weight's dtype.
"""

from __future__ import annotations

from snugfit.plan.plan import OptimizerPlan

MASTER_BYTES = {"fp32": 4, "bf16": 2}
PLAIN_STATE_BYTES = {"fp32": 4, "bf16": 2}
# bytes per element, elements per scale, lookup-table entries (torchao.optim.AdamW8bit / AdamW4bit's defaults)
QUANTIZED = {"8bit": (1.0, 256, 256), "4bit": (0.5, 128, 16)}
MIN_QUANTIZED = 4096  # torchao quantizes tensors of at least this many elements (as bitsandbytes does)

# An update's cost on a CPU relative to fused fp32 AdamW (Host.adam_params_per_s, which profile-hardware measures):
# torchao's compiled update per tensor, measured on this project's 2-core machine with 6 tensors of 2048 x 2048
# (fused fp32 2.7e8 elements/s; _AdamW on fp32 or bf16 states 8.6e7, AdamW8bit 7.4e6, AdamW4bit 4.2e6). Its
# quantization is a binary search per element, which the CPU's vector units do not speed up as they do AdamW's.
HOST_STEP_SLOWDOWN = {"plain": 1.0, "torchao": 3.1, "8bit": 36.0, "4bit": 63.0}


def master_bytes(opt: OptimizerPlan) -> int:
    """Bytes of one trainable weight as the optimizer updates it (its gradient shard has the same dtype)."""
    return MASTER_BYTES[opt.master_weights]


def tensor_state_bytes(opt: OptimizerPlan, n: int) -> float:
    """Bytes of AdamW's two states for one tensor of n elements (this rank's shard of it)."""
    if opt.states in QUANTIZED:
        per, block, table = QUANTIZED[opt.states]
        if n >= MIN_QUANTIZED and n % block == 0:
            return 2 * (per * n + 4 * (n // block) + 4 * table)
        return 2 * MASTER_BYTES[opt.master_weights] * n  # torchao keeps it plain, in the weight's dtype
    return 2 * PLAIN_STATE_BYTES[opt.states] * n


def state_bytes(opt: OptimizerPlan, matrices: list[int], trainable: int, div: int) -> int:
    """Bytes of AdamW's states for a piece's `trainable` elements, of which `matrices` are its 2-D tensors' sizes
    (the rest are vectors), each sharded `div` ways. A piece whose tensors are not known counts as one tensor."""
    matrices = matrices or [trainable]
    vectors = max(0, trainable - sum(matrices))
    shard = [-(-n // div) for n in matrices]
    return int(sum(tensor_state_bytes(opt, n) for n in shard) + tensor_state_bytes(opt, -(-vectors // div)) * (
        vectors > 0))


def update_bytes(opt: OptimizerPlan) -> float:
    """Bytes a device's AdamW moves per element: the weight read and written, the gradient read, both states read
    and written (quantized ones at their code size; their scales are a 1/128 more)."""
    state = QUANTIZED[opt.states][0] * 1.02 if opt.states in QUANTIZED else PLAIN_STATE_BYTES[opt.states]
    return 3 * MASTER_BYTES[opt.master_weights] + 4 * state


def host_step_slowdown(opt: OptimizerPlan) -> float:
    """How many times longer than fused fp32 AdamW an update of the same elements takes on a CPU."""
    if opt.states in QUANTIZED:
        return HOST_STEP_SLOWDOWN[opt.states]
    return HOST_STEP_SLOWDOWN["torchao" if opt.needs_torchao else "plain"]


def describe(opt: OptimizerPlan, clip: bool = True) -> str:
    """'AdamW, 8-bit states, bf16 weights (stochastic rounding), stepped in backward (clipped per unit)'."""
    states = {"fp32": "fp32 states", "bf16": "bf16 states", "8bit": "8-bit states", "4bit": "4-bit states"}
    parts = [f"AdamW, {states[opt.states]}", "bf16 weights (stochastic rounding)" if opt.master_weights == "bf16"
             else "fp32 weights"]
    if opt.in_backward:
        parts.append("stepped in backward" + (" (gradients clipped per unit)" if clip else ""))
    elif clip:
        parts.append("gradients clipped by their global norm")
    return ", ".join(parts)
