"""MoE-Lightning's CGOPipe (arXiv 2411.11217 §4, Alg. 1, App. A): decode with the KV cache in host memory and
attention on the host CPU (JAX's CPU backend in the same process), while the QKV and output projections and the MoE
FFN run on the accelerator with paged expert weights, in one pipeline over micro-batches.

Built so far: the host KV cache (host_kv), one layer's decode attention over it (host_attention), a micro-benchmark
of that attention's GB/s (host_attention_bench) and the request batching of App. A.2, Alg. 2 (balance: requests into
micro-batches of balanced token counts; one decode step's rows into balanced groups). The placement, the share of the
cache kept on the accelerator (r_c), the paged weight transfers and the pipelined schedule come later."""
