"""One rank's engine and the requests it runs: the request and its validation, the event stream,
sequences, reference-image conditioning, sampling, the text phase with its decode step (CUDA graph), the
KV hand-off, the denoise phase, the decisions all ranks agree on; the phase program that runs them in
order, readable top to bottom (program.py), the scheduler that batches the programs' needs
(scheduler.py) and the engine that owns what they share (engine.py).

May import `engine.model`, `engine.parallel`, `engine.checkpoint` and `hunyuan_kernels`; never the server.
"""
