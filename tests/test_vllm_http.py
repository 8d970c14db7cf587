"""verl's vLLM HTTP servers, narrowed (``gtpo.verl_plugin.vllm_http``): no LoRA adapter loaded over HTTP, and vLLM's
OpenAI API closed to everyone (a key nobody is told) unless a reward model served by vLLM needs it. Checked against
vLLM's own app code: its LoRA router and its authentication middleware, given the environment a server process gets.

    .venv/bin/python -m pytest -q -n 0 tests/test_vllm_http.py
"""

from __future__ import annotations

import argparse

from fastapi import FastAPI
from omegaconf import OmegaConf
from starlette.testclient import TestClient

from gtpo.verl_plugin.vllm_http import PRIVATE_API_FLAG, lock_api, runtime_env_vars


def test_the_runtime_env_closes_the_api_unless_a_reward_model_needs_it():
    run = OmegaConf.create({"reward": {"reward_model": {"enable": False}}})
    assert runtime_env_vars(run, {}) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false", PRIVATE_API_FLAG: "1"}
    with_rm = OmegaConf.create({"reward": {"reward_model": {"enable": True}}})
    assert runtime_env_vars(with_rm, {}) == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"}
    # what the runtime env sets already stays (a user who serves adapters over HTTP on purpose)
    assert runtime_env_vars(run, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}) == {PRIVATE_API_FLAG: "1"}


def test_each_process_locks_its_own_vllm_with_a_key_nobody_knows():
    env = {PRIVATE_API_FLAG: "1"}
    assert lock_api(env) and len(env["VLLM_API_KEY"]) == 64
    other = {PRIVATE_API_FLAG: "1"}
    assert lock_api(other) and other["VLLM_API_KEY"] != env["VLLM_API_KEY"]
    assert not lock_api(env)  # once per process; a key the user set is kept
    user = {PRIVATE_API_FLAG: "1", "VLLM_API_KEY": "users-own"}
    assert not lock_api(user) and user["VLLM_API_KEY"] == "users-own"
    assert not lock_api({}) and not lock_api({PRIVATE_API_FLAG: "0"})


def _vllm_app(monkeypatch, environ: dict[str, str]) -> TestClient:
    """An app with vLLM's middleware and LoRA router as vLLM's ``build_app`` adds them, in ``environ``."""
    from vllm.entrypoints.serve.lora.api_router import attach_router
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    for key in ("VLLM_API_KEY", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", PRIVATE_API_FLAG):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    lock_api()  # what gtpo.verl_plugin.register runs in the server's process
    app = FastAPI()
    app.get("/v1/models")(lambda: {"data": []})
    app.get("/health")(lambda: {})
    attach_router(app)
    args = argparse.Namespace(
        allowed_origins=["*"], allow_credentials=False, allowed_methods=["*"], allowed_headers=["*"], api_key=None,
        enable_request_id_headers=False, middleware=[],
    )  # fmt: skip
    init_entrypoints_middleware(args, app, ())
    return TestClient(app)


def test_vllms_own_app_refuses_everyone_and_mounts_no_lora_loading(monkeypatch):
    import gtpo.verl_plugin.register  # noqa: F401  (imported by verl in every process)

    # verl's runtime env alone: open API, adapters loadable over HTTP
    open_app = _vllm_app(monkeypatch, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    assert open_app.get("/v1/models").status_code == 200
    assert any(getattr(r, "path", "") == "/v1/load_lora_adapter" for r in open_app.app.routes)
    # with the recipe's runtime env on top
    closed = _vllm_app(monkeypatch, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false", PRIVATE_API_FLAG: "1"})
    assert closed.get("/v1/models").status_code == 401
    assert closed.get("/v1/models", headers={"Authorization": "Bearer guess"}).status_code == 401
    assert closed.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 401
    assert not any(getattr(r, "path", "") == "/v1/load_lora_adapter" for r in closed.app.routes)
    assert closed.get("/health").status_code == 200  # unguarded by vLLM's design: it generates nothing


def test_the_entry_point_puts_it_into_the_runtime_env(monkeypatch):
    """What ``prepare_config`` hands ``ray.init``: the flag and the LoRA switch, never a key."""
    import gtpo.verl_plugin.register  # noqa: F401
    from recipe.gtpo.main_gtpo import prepare_config
    from tests.support.configs import compose

    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)  # prepare_config sets it; restored afterwards
    # backend=cpu_tiny's device stays cpu whatever platform verl detected first in this process (CUDA's, alone)
    monkeypatch.setattr("recipe.gtpo.main_gtpo.auto_set_device", lambda config: None)
    cfg = compose(["backend=cpu_tiny"])
    prepare_config(cfg, dry_run=True)
    env_vars = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    assert env_vars["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "false" and env_vars[PRIVATE_API_FLAG] == "1"
    assert "VLLM_API_KEY" not in env_vars
