"""The start-up check of a run's gs:// paths against a GCS emulator: a missing bucket, an endpoint that does not
answer and missing credentials are one error naming the config key and path, within seconds."""
import time

import pytest

from llds_jax.runtime import gcs


def test_existing_buckets_pass(gcs_dir):
    gcs.check_buckets({"run_dir": f"{gcs_dir}/run", "model.path": f"{gcs_dir}/no_model_yet"})
    gcs.check_buckets({})


def test_missing_bucket_is_named(gcs_dir):
    with pytest.raises(FileNotFoundError, match="^data.train_files\\[0\\] gs://no-such-bucket/train.parquet: "
                                                "bucket gs://no-such-bucket does not exist$"):
        gcs.check_buckets({"run_dir": f"{gcs_dir}/run", "data.train_files[0]": "gs://no-such-bucket/train.parquet"})


def test_unreachable_endpoint_fails_at_once(gcs_bucket, unreachable_gcs_env, monkeypatch):
    url = unreachable_gcs_env["STORAGE_EMULATOR_HOST"]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    start = time.monotonic()
    with pytest.raises(gcs.GCSUnavailableError, match=f"^run_dir {gcs_bucket}/run: Google Cloud Storage at {url} "
                                                      f"did not answer \\(ConnectionError\\)$"):
        gcs.check_buckets({"run_dir": f"{gcs_bucket}/run"})
    assert time.monotonic() - start < 5


def test_missing_credentials_are_named(gcs_bucket, tmp_path, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")  # real GCS, whose client looks for credentials first
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud application-default credentials
    with pytest.raises(gcs.GCSUnavailableError, match=f"^model.path {gcs_bucket}/model: no usable Google Cloud "
                                                      f"credentials \\(DefaultCredentialsError: [^\\n]*\\)$"):
        gcs.check_buckets({"model.path": f"{gcs_bucket}/model"})
