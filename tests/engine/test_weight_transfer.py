"""mxload's weight-transfer backend, driven by vLLM's own code.

The RL path of vLLM 0.30.0: ``LLM.init_weight_transfer_engine`` / ``start_weight_update``
/ ``update_weights`` / ``finish_weight_update`` call the worker's methods of the same
names, which drive the backend ``WeightTransferEngineFactory.create_engine`` built from
``weight_transfer_config.backend``. Here, from the vLLM 0.30.0 wheel (downloaded at test
time, ``tests/engine/sources.py``):

* ``vllm/distributed/weight_transfer/base.py`` and ``factory.py`` are imported for real:
  mxload's backend subclasses that ``WeightTransferEngine``, registers itself with that
  factory (:func:`mxload.orchestrator.hosts.engine_ext.register_weight_transfer`, mxload's
  ``vllm.general_plugins`` entry point) and is built by ``create_engine``;
* the worker's methods (``init_weight_transfer_engine``, ``start_weight_update``,
  ``_start_weight_update``, ``start_draft_weight_update``, ``update_weights``,
  ``finish_weight_update``, ``_check_weight_transfer_engine``) are compiled from
  ``vllm/v1/worker/gpu_worker.py`` (the module itself needs CUDA) onto a worker object.

Stand-ins, named: every other ``vllm`` module (:class:`tests.engine.sources.Stub`), with
``vllm.config.set_current_vllm_config`` a null context and ``vllm.distributed``'s rank
functions answering rank 0; ``torch.accelerator.synchronize`` (needs a device);
``vllm_ascend.ascend_config.get_ascend_config`` answering ``weight_nz_mode`` 0. What the
parameters must hold comes from ``tests/reference_model.py`` (no mxload code).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mxload.orchestrator.errors import AddressMoved, InputError
from mxload.orchestrator.hosts.engine_ext import register_weight_transfer
from mxload.orchestrator.plan.planner import build_plan
from mxload.orchestrator.plan.types import ParallelLayout
from mxload.orchestrator.runtime.catalog import open_checkpoint

from tests.engine import sources
from tests.engine.sources import Stub, stubbed_packages
from tests.reference_model import Layout, RefCheckpoint, compare_rank, expected_rank
from tests.unit.test_engine_ext import _engine_model

ENGINE = "vllm-ascend-0.30.0rc2"
WORKER_METHODS = (
    "_check_weight_transfer_engine",
    "init_weight_transfer_engine",
    "start_weight_update",
    "start_draft_weight_update",
    "_start_weight_update",
    "update_weights",
    "finish_weight_update",
)


def worker_class(gpu_worker: Path, namespace: dict[str, Any]) -> type:
    """A class with vLLM's own Worker methods (WORKER_METHODS), compiled from its file."""
    tree = ast.parse(gpu_worker.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Worker")
    body = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in WORKER_METHODS]
    assert {f.name for f in body} == set(WORKER_METHODS)
    module = ast.Module(body=[ast.ClassDef("Worker", [], [], body, [])], type_ignores=[])
    code = compile(ast.fix_missing_locations(module), str(gpu_worker), "exec")
    exec(code, namespace)
    return namespace["Worker"]  # type: ignore[no-any-return]


@contextlib.contextmanager
def vllm_worker(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A worker with vLLM 0.30's own weight-transfer methods over ``model`` (tp 1), its
    backend built by vLLM's real factory from ``backend="mxload"``."""
    root = sources.vllm_wheel("0.30.0")
    wt = "vllm.distributed.weight_transfer"
    real = {
        f"{wt}.base": root / "vllm/distributed/weight_transfer/base.py",
        f"{wt}.factory": root / "vllm/distributed/weight_transfer/factory.py",
    }
    ascend = SimpleNamespace(weight_nz_mode=0, enable_fused_mc2=0, eplb_config=None)
    given = {
        "vllm.logger": Stub("vllm.logger", init_logger=lambda name: sources.QuietLogger()),
        "vllm.distributed": Stub(
            "vllm.distributed",
            Path("/nonexistent"),
            get_tensor_model_parallel_rank=lambda: 0,
            get_pp_group=lambda: SimpleNamespace(rank_in_group=0),
        ),
        "vllm_ascend.ascend_config": Stub(
            "vllm_ascend.ascend_config", get_ascend_config=lambda: ascend
        ),
    }
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            data_parallel_size=1,
            pipeline_parallel_size=1,
            enable_expert_parallel=False,
            data_parallel_rank=0,
            world_size=1,
        ),
        model_config=SimpleNamespace(),
    )
    with stubbed_packages({"vllm", "vllm_ascend"}, real, given):
        factory = importlib.import_module(f"{wt}.factory")
        register_weight_transfer()
        register_weight_transfer()  # vLLM loads plugins in every process, maybe twice
        backend = factory.WeightTransferEngineFactory.create_engine(
            SimpleNamespace(backend="mxload"), vllm_config, torch.device("cpu"), model
        )
        Worker = worker_class(
            root / "vllm/v1/worker/gpu_worker.py",
            {"set_current_vllm_config": lambda c: contextlib.nullcontext()},
        )
        worker = Worker()
        worker.vllm_config = vllm_config
        worker.rank = 0
        worker.weight_transfer_engine = backend
        worker._weight_update_active = False
        worker._weight_update_is_draft = False
        worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
        yield worker


def test_backend_through_vllm_factory_and_worker(ckpt_factory, monkeypatch) -> None:
    src = {s: ckpt_factory("qwen3-moe-tiny", seed=s) for s in (1, 2)}
    layout = ParallelLayout(tp=1)
    meta = open_checkpoint(src[1])
    model = _engine_model(build_plan(meta.config, layout, checkpoint=meta, engine=ENGINE).ranks[0])

    with vllm_worker(model, monkeypatch) as worker:
        from mxload.orchestrator.hosts.weight_transfer import weight_identity

        worker.init_weight_transfer_engine({"src": src[1], "engine": ENGINE})
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        one = Layout(1, 1, 1, False, "linear")
        want = {s: expected_rank(RefCheckpoint(p), one, 0) for s, p in src.items()}
        idents = []
        for i, s in enumerate((2, 1, 2), start=1):
            worker.start_weight_update()
            worker.update_weights({"src": src[s]})
            idents.append(weight_identity(worker))
            worker.finish_weight_update()
            held = {n: p.data.contiguous() for n, p in model.named_parameters()}
            held = {n.replace(".routed_experts.", "."): t for n, t in held.items()}
            bad = compare_rank(want[s], held)
            assert bad == [], f"update {i}: {bad[:5]}"
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
        assert [x.split(":")[0] for x in idents] == ["1", "2", "3"]
        assert idents[0].split(":")[1] == idents[2].split(":")[1] != idents[1].split(":")[1]
        # The draft model is not planned: vLLM's own worker refuses the draft update.
        with pytest.raises(RuntimeError, match="does not support draft model weight updates"):
            worker.start_draft_weight_update()
        # A parameter the engine rebinds between updates is refused at start, by name.
        p = model.get_parameter("model.layers.0.self_attn.o_proj.weight")
        p.data = p.data.clone()
        with pytest.raises(AddressMoved, match=r"self_attn\.o_proj\.weight"):
            worker.start_weight_update()


def test_trainer_form_through_vllm_factory_and_worker(ckpt_factory, monkeypatch) -> None:
    """init / start / update / finish with the trainer form: two trainer ranks (threads
    here, each with its own gloo member) push FSDP dim-0 shards of the BF16 twin; the
    identity read back is the trainer step."""
    import threading

    from mxload.orchestrator.hosts.weight_transfer import weight_identity
    from mxload.orchestrator.plan.trainer import fsdp_manifest, manifest_to_json
    from mxload.orchestrator.runtime.refit import MxloadSender

    from tests.refit_trainer import free_port, read_checkpoint, shards

    fp8 = ckpt_factory("qwen3-moe-tiny", seed=1)
    twins = {s: ckpt_factory("qwen3-moe-tiny", seed=s, bf16=True) for s in (1, 2)}
    layout = ParallelLayout(tp=1)
    meta = open_checkpoint(fp8)
    model = _engine_model(build_plan(meta.config, layout, checkpoint=meta, engine=ENGINE).ranks[0])
    full = {s: read_checkpoint(p) for s, p in twins.items()}
    manifest = fsdp_manifest({n: tuple(t.shape) for n, t in full[1].items()}, 2)
    port = free_port()
    trainer = {
        "transport": "gloo",
        "addresses": [f"127.0.0.1:{port}"],
        "world": 2,
        "manifest": manifest_to_json(manifest),
        "bucket_bytes": 1 << 16,
        "group": f"vllm-api-{port}",
        "timeout_s": 30,
    }
    senders: list[Any] = [None, None]

    def join(r: int) -> None:
        senders[r] = MxloadSender(fp8, layout, trainer, rank=r, engine=ENGINE)

    def together(main: Any, *others: Any) -> None:
        threads = [threading.Thread(target=f) for f in others]
        for t in threads:
            t.start()
        try:
            main()
        finally:
            for t in threads:
                t.join(timeout=60)

    one = Layout(1, 1, 1, False, "linear")
    like = RefCheckpoint(fp8)
    with vllm_worker(model, monkeypatch) as worker:
        together(
            lambda: worker.init_weight_transfer_engine(
                {"src": fp8, "engine": ENGINE, "trainer": trainer}
            ),
            lambda: join(0),
            lambda: join(1),
        )
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        for step, seed in ((3, 2), (4, 1)):
            worker.start_weight_update()
            together(
                lambda step=step: worker.update_weights(
                    {"step": step, "manifest_hash": manifest.digest()}
                ),
                *[
                    lambda r=r, step=step, seed=seed: senders[r].send_weights(
                        shards(full[seed], r, 2), step
                    )
                    for r in range(2)
                ],
            )
            ident = weight_identity(worker)
            worker.finish_weight_update()
            assert ident == f"{step}:trainer-{manifest.digest()}"
            held = {
                n.replace(".routed_experts.", "."): p.data.contiguous()
                for n, p in model.named_parameters()
            }
            want = expected_rank(RefCheckpoint(twins[seed]), one, 0, like=like)
            assert compare_rank(want, held) == [], f"step {step}"
            assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
        # An update naming both a checkpoint and a step is refused by the backend.
        worker.start_weight_update()
        with pytest.raises(InputError, match="either 'src'"):
            worker.update_weights({"src": fp8, "step": 5, "manifest_hash": manifest.digest()})
        worker.weight_transfer_engine.shutdown()
        for s in senders:
            s.close()
