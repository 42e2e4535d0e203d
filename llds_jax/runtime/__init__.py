"""The run's I/O: what a run does to the machines and folders around it, apart from its numerics.

- `storage`: every write of a run as a bounded operation whose failure is one `StorageError`;
- `lease`: one writer per run folder (or index `--out`);
- `output_folder`: folders written only when they are the project's, never deleted;
- `gcs`: gs:// folder copies and the start-up check of a run's buckets;
- `redaction`: the one redaction of URL user info in everything printed or saved;
- `distributed`: multi-host start-up (`jax.distributed`) and host agreement.

A leaf package: its modules import nothing of llds_jax but `llds_jax.errors` and each other
(tests/architecture/test_import_graph.py), so the run-config schema (`llds_jax.config`, through `redaction`) and
every layer above may use them. Import from the defining module (`llds_jax.runtime.storage`, ...): this package
imports nothing, so `redaction` loads without JAX.
"""
