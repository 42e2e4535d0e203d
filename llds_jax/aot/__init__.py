"""The ahead-of-time pod tools of `--mode=compile`: a run's programs compiled for a TPU topology on this machine,
their memory per chip and an estimated step time. A CPU run never loads them.

- `compile_check`: the mode itself (lower and compile every program, the memory table, the step estimate's lines);
- `step_estimate`: the step time from the programs' rooflines and the rollout's calls;
- `rollout_schedule`: the paged engine's step calls at expected lengths (the real scheduler, scripted turns);
- `step_lengths`: those lengths, from a run's logged metrics or stated defaults;
- `roofline`: a compiled program's FLOPs, HBM and ICI bytes per chip, and its time at a generation's peaks;
- `hlo_text`: the parser of compiled HLO text the roofline reads.

The package sits on top of the library: only `llds_jax.launch` imports it (tests/architecture/test_import_graph.py).
The two leaves it shares with the library stay at the top level: `llds_jax.programs` (the protocol the train step,
the rollout and the on-chip retriever implement to name their programs) and `llds_jax.topologies` (the TPU slices,
which `llds_jax.checks` checks `mesh.topology` against). Inside this package they would make a circle of packages:
the components and the checks import them, and the compile check imports the components and the checks.
Import from the defining module (`llds_jax.aot.compile_check`, ...): this package imports nothing.
"""
