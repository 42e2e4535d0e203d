"""gs:// paths: folder copies between GCS and a local disk, and the start-up check of a run's buckets.

Every run artifact may live on GCS (docs/gcs.md says which library reaches it for what). Hugging Face tokenizers
cannot: `transformers` loads and saves only local folders, so their files are copied (`copy_files`) between GCS and a
temporary local folder. (The embedded BM25 index is memory-mapped and must be on a local disk.)

GCS clients retry a failing request for minutes (against a closed port: google-cloud-storage 120 s, gcsfs 35 s,
tensorstore over 5 minutes), so `check_buckets` makes one request per bucket, without retries, before a run starts:
an unreachable endpoint, missing credentials, a denied access or a missing bucket becomes one error naming the config
key and path instead of a long hang.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from etils import epath

SCHEME = "gs://"
PUBLIC_ENDPOINT = "https://storage.googleapis.com"


class GCSUnavailableError(OSError):
    """A gs:// path cannot be used: GCS is unreachable, there are no credentials or the access is denied."""


def is_gcs(path: str | os.PathLike) -> bool:
    """True for a gs://bucket/... path."""
    return os.fspath(path).startswith(SCHEME)


def split(path: str) -> tuple[str, str]:
    """("bucket", "object/prefix") of "gs://bucket/object/prefix"."""
    bucket, _, prefix = path[len(SCHEME):].partition("/")
    return bucket, prefix.strip("/")


def list_files(folder: str | os.PathLike) -> list[str]:
    """Names of the files directly in `folder` (local or gs://), sorted; [] when it does not exist."""
    root = epath.Path(folder)
    try:
        return sorted(p.name for p in root.iterdir() if p.is_file())
    except FileNotFoundError:  # gcsfs: missing folder or bucket; local: missing folder
        return []


def copy_files(source: str | os.PathLike, target: str | os.PathLike, names: Iterable[str]) -> None:
    """Copies the files `names` from folder `source` to folder `target` (each local or gs://; `target` is
    created)."""
    src, dst = epath.Path(source), epath.Path(target)
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        (dst / name).write_bytes((src / name).read_bytes())


def endpoint() -> str:
    """The GCS endpoint the clients talk to: STORAGE_EMULATOR_HOST (an emulator) or the public one."""
    return os.environ.get("STORAGE_EMULATOR_HOST") or PUBLIC_ENDPOINT


def check_buckets(paths: Mapping[str, str], timeout_s: float = 30.0) -> None:
    """Lists at most one object under the first path of each bucket in `paths` ({config key: gs:// path}), once,
    without retries, each request timing out after `timeout_s` seconds.

    Raises:
      FileNotFoundError: a bucket does not exist.
      GCSUnavailableError: google-cloud-storage is missing, there are no usable credentials, the access is denied
        or the endpoint does not answer.
    Each message is one line naming the config key and path (never a credential).
    """
    first: dict[str, tuple[str, str]] = {}
    for key, path in paths.items():
        first.setdefault(split(path)[0], (key, path))
    if not first:
        return
    try:
        import google.auth.exceptions
        import requests
        from google.api_core import exceptions
        from google.cloud import storage
    except ImportError as e:
        key, path = next(iter(first.values()))
        raise GCSUnavailableError(f"{key} is on GCS ({path}) but {e.name} is not installed: "
                                  f"pip install gcsfs google-cloud-storage (the 'tpu' extra)") from None
    client = None
    for bucket, (key, path) in first.items():
        where = f"{key} {path}"
        try:
            client = client or storage.Client()
            next(iter(client.list_blobs(bucket, prefix=split(path)[1], max_results=1, timeout=timeout_s,
                                        retry=None)), None)
        except google.auth.exceptions.GoogleAuthError as e:
            raise GCSUnavailableError(f"{where}: no usable Google Cloud credentials ({type(e).__name__}: "
                                      f"{_first_line(e)})") from None
        except exceptions.NotFound:
            raise FileNotFoundError(f"{where}: bucket gs://{bucket} does not exist") from None
        except (exceptions.Forbidden, exceptions.Unauthorized) as e:
            raise GCSUnavailableError(f"{where}: access denied (HTTP {e.code}); the account needs read/write "
                                      f"access to gs://{bucket}") from None
        except requests.RequestException as e:
            raise GCSUnavailableError(f"{where}: Google Cloud Storage at {endpoint()} did not answer "
                                      f"({type(e).__name__})") from None
        except exceptions.GoogleAPICallError as e:
            raise GCSUnavailableError(f"{where}: listing gs://{bucket} failed (HTTP {e.code})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no details"
