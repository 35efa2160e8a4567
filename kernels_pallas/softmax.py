"""The online-softmax conventions all three attention kernels share (Triton, Mosaic prefill,
Mosaic decode), and so do their split-K merges (`attention.merge_splits`,
`attention_mgpu_decode.combine_splits`): one definition, so a partial written by one piece of
code means the same to the code that merges it.
"""

from __future__ import annotations

# Logits are scaled by log2(e) once and the softmax runs in exp2 (one instruction on a GPU).
LOG2E = 1.4426950408889634
# A masked logit, and a row's running max before its first key (an empty split-K partial
# keeps it): finite, where -inf would make m_prev - m_new an inf - inf = NaN.
MASK_VALUE = -1e30
# The kernels' softmax probabilities are p * 2^P_LOG2_GAIN (exp2 of the logit less the row max
# less this), and so is their running sum l, so O = acc / l does not change. Why: P enters
# fp16 PV products, and fp16 flushes p < 2^-24 to zero while l would still count it (an
# attention sink 18 nats above 4k other keys lost their whole 6e-5 share of the output); with
# the gain p keeps its bits down to 2^-39, and p <= 2^15 stays far below fp16's 65504.
P_LOG2_GAIN = 15.0
