"""Running one request on one rank: the request and its validation, the event stream, sequences,
reference-image conditioning, sampling, the text phase with its decode step (CUDA graph), the KV
hand-off, the denoise phase, the decisions all ranks agree on, and the pipeline that runs them in
order, readable top to bottom.

May import `engine.model`, `engine.parallel`, `engine.spec` and `hunyuan_kernels`; never the server.
"""
