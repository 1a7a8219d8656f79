"""What the pages say of an engine by its description: its KV pool named for its device
(GPU KV blocks on CUDA, CPU KV blocks on the CPU, KV blocks for the simulator), and
whether its model has a chat template (the submit forms default to chat for it)."""
import json
import re

import pytest

from kvops.engines.registry import register_engine
from kvops.views import kv_blocks_label

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("device, label", [
    ("cuda", "GPU KV blocks"), ("cuda:1", "GPU KV blocks"), ("cpu", "CPU KV blocks"),
    ("simulated", "KV blocks"), (None, "KV blocks")])
def test_the_pool_is_named_for_the_engines_device(device, label):
    assert kv_blocks_label({"device": device}) == label


def test_the_overview_names_each_pool_and_knows_which_models_chat(client):
    from django.contrib.auth.models import User

    from engine.model.default_model import default_model_dir
    folder = default_model_dir()
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("default model not converted (run `make setup`)")
    base = {"block_size": 16, "num_gpu_blocks": 64, "num_cpu_blocks": 0}
    register_engine("instruct", "w1@h", "h", "i1", {**base, "device": "simulated", "simulate": True,
                                                    "tokenizer_path": str(folder)}, "s1")
    register_engine("bytes", "w2@h", "h", "i2", {**base, "device": "simulated", "simulate": True,
                                                 "tokenizer_path": None}, "s1")
    register_engine("far", "w3@h", "h", "i3", {**base, "device": "cpu",
                                               "model_path": "/nowhere/model"}, "s1")
    client.force_login(User.objects.create_user("dora"))
    overview = client.get("/").content.decode()
    pools = re.findall(r'data-f="pool">([^<]*)<', overview)
    assert sorted(pools) == ["64 CPU KV blocks of 16 tokens", "64 KV blocks of 16 tokens",
                             "64 KV blocks of 16 tokens"]
    chat = {"instruct": True, "bytes": False, "far": None}  # far: not readable here
    assert chat_engines(overview) == chat
    assert chat_engines(client.get("/jobs/").content.decode()) == chat


def chat_engines(page: str) -> dict:
    return json.loads(re.search(r'id="chat-engines" type="application/json">([^<]*)<', page)[1])
