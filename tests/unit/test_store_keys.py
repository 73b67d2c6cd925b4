"""core/storage.py and training/checkpoint/in_store.py without a server: where things go in the bucket, and the credentials a Store signs with."""
from core.storage import Store
from training.checkpoint.in_store import checkpoints_prefix, part_key


def test_keys_follow_the_documented_layout():
    store = Store("s3://bucket/team/llm/")
    assert (store.bucket, store.prefix) == ("bucket", "team/llm")
    assert checkpoints_prefix(store, "run-1") == "team/llm/runs/run-1/checkpoints"
    assert part_key(store, "run-1", "checkpoint-6", 1) == "team/llm/runs/run-1/checkpoints/checkpoint-6/.parts/node-1.json"
    assert Store("s3://bucket").key("d5a0", "manifest.json") == "d5a0/manifest.json"


def test_a_store_signs_with_the_credentials_of_its_time(monkeypatch):
    """boto3's default session keeps the first credentials it read for the whole process: a second store (another
    endpoint, other keys) in the same process must not sign with the first one's."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s1")
    assert Store("s3://bucket").client._request_signer._credentials.access_key == "first"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    store = Store("s3://bucket")
    assert store.client._request_signer._credentials.access_key == "second"
    assert store.client.meta.endpoint_url == "http://127.0.0.1:9"


def test_two_nodes_creating_the_bucket_at_once_both_go_on_and_other_errors_still_fail():
    """Two nodes of one run start together: both find no bucket and both create it; the second create is answered
    BucketAlreadyOwnedByYou (SeaweedFS did, and the node ended with exit code 2: a clean-clone CI failure). Any other
    refusal is still an error."""
    import pytest
    from botocore.exceptions import ClientError

    class Client:
        def __init__(self, code):
            self.code, self.created = code, 0

        def head_bucket(self, Bucket):
            raise ClientError({"Error": {"Code": "404"}}, "HeadBucket")

        def create_bucket(self, Bucket):
            self.created += 1
            raise ClientError({"Error": {"Code": self.code}}, "CreateBucket")

    store = Store("s3://pipeline/apart")
    store.client = Client("BucketAlreadyOwnedByYou")
    store.ensure_bucket()
    assert store.client.created == 1
    store.client = Client("AccessDenied")
    with pytest.raises(ClientError, match="AccessDenied"):
        store.ensure_bucket()
