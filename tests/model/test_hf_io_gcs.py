"""Checkpoint folders on gs:// (a GCS emulator): sharded import equal to the local folder's, export, errors."""
import jax
import numpy as np
import pytest
from flax import nnx

from llds_jax import parallel
from llds_jax.model import hf_io


def _params(model):
    return {parallel.path_str(p): np.asarray(jax.device_get(v.get_value()))
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_gcs_folder_loads_the_local_parameters_on_their_shards(hf_checkpoint, gcs_dir, gcs_fs):
    folder, _ = hf_checkpoint("qwen2_untied")
    gcs_fs.put(folder, f"{gcs_dir}/model", recursive=True)
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    local = hf_io.load_model(folder, mesh=mesh)
    remote = hf_io.load_model(f"{gcs_dir}/model", mesh=mesh)
    assert remote.cfg == local.cfg
    ours, reference = _params(remote), _params(local)
    assert sorted(ours) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    q_proj = nnx.state(remote, nnx.Param)["layers"]["q_proj"].get_value()
    assert q_proj.sharding.spec == parallel.spec_for("layers/q_proj")


def test_export_to_gcs_reads_back_equal(hf_checkpoint, gcs_dir):
    folder, _ = hf_checkpoint("qwen2_tied")
    model = hf_io.load_model(folder)
    hf_io.save_model(model, f"{gcs_dir}/export", max_shard_bytes=20_000)  # sharded, with an index
    again = hf_io.load_model(f"{gcs_dir}/export")
    assert again.cfg == model.cfg
    ours, reference = _params(again), _params(model)
    for name, value in reference.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


@pytest.mark.parametrize("where", ["missing_folder", "missing_bucket"])
def test_missing_gcs_checkpoint_is_named(gcs_dir, where):
    path = f"{gcs_dir}/no_model" if where == "missing_folder" else "gs://no-such-bucket/model"
    with pytest.raises(FileNotFoundError, match=f"^{path}: no model.safetensors or model.safetensors.index.json"):
        hf_io.load_model(path)
