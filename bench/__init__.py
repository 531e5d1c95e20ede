"""The benchmarks: one command, `python -m bench SUITE [options]` (`python -m bench --help` lists the
suites). Each suite is a module of `bench.suites`; what they share: `timing` (how a call is timed),
`checks` (how a fast path is checked before it is timed), `report` (what a run writes to $OUT),
`variants` (running a kernel variant by name), `ablations` (variants registered by the benches only),
`profiling` (kernel tables), `rank` (one rank of a plan at the real shapes on one GPU).
A development tool: nothing at run time imports it."""
