"""MoE-Lightning's CGOPipe (arXiv 2411.11217 §4, Alg. 1, App. A): decode with the KV cache in host memory and
attention on the host CPU (JAX's CPU backend in the same process), while the QKV and output projections and the MoE
FFN run on the accelerator with paged expert weights, in one pipeline over micro-batches.

The parts: the host KV cache (host_kv), one layer's decode attention over it (host_attention, its micro-benchmark
host_attention_bench), the request batching of App. A.2, Alg. 2 (balance), the paged experts (pages), the launch
order (schedule) and its executor (cgopipe_steps), the policy (policy). The search's other policies run in the same
executor: the MoE FFN on the host (host_ffn, F_g = 0) and attention on the device over KV swapped in from the host
(kv_swap, A_g = 1 with r_c < 1)."""
