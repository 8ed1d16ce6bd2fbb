"""The 2-rank paths a user reaches through PaddleNLP's ``llm/run_pretrain.py`` with paddle_mgrad
switched on by ``PADDLE_MGRAD=all`` alone, each compared loss by loss with a one-process plain
run (no paddle_mgrad, no recompute, no parallelism) of the same global batch.

The script is tests/nlp/llm/run_pretrain.py (PaddleNLP 2.8-style, PaddleNLP's Trainer and
TrainingArguments), run unmodified with PaddleNLP's own flags: ``--tensor_parallel_degree 2
--tensor_parallel_config ...``, ``--sequence_parallel``, ``--pipeline_parallel_degree 2``,
``--sharding stage1``; always ``--recompute --recompute_granularity full`` (+ master grads), in
both ``--recompute_use_reentrant`` modes.  Both runs start from the same saved tiny model
(``--model_name_or_path --continue_training``: PaddleNLP splits it for TP and maps it onto the
pipeline model for PP).

Which recompute each path reaches (PaddleNLP 2.8.1):

* TP2 / TP2+SP / sharding stage1 (``LlamaForCausalLM``): the decoder layers call fleet's
  ``recompute(..., use_reentrant=config.recompute_use_reentrant)``.  TP's ``RowParallelLinear``
  all-reduces its linear's output IN PLACE (``mp_allreduce_eager``) inside that recomputation
  -- a replayed linear whose output is a leaf fails there ("Leaf Var () that doesn't stop
  gradient can't use inplace strategy", non-reentrant).
* PP2: ``LlamaForCausalLMPipe`` hard-codes ``recompute_interval = 0`` (its decoder layers call
  ``recompute`` themselves: ``pp2_llama``); ``QWenForCausalLMPipe`` passes
  ``--pp_recompute_interval`` to ``PipelineLayer``, whose forward then runs fleet's
  ``recompute_hybrid`` (``pp2_qwen_hybrid``).  ``recompute_hybrid`` is a PyLayer with no
  ``use_reentrant``: both flag values run the same path there (asserted by the counters).

Paddle's missing CPU transport is stood in for by tests/fleet/launch/cpu_fleet_standins.py,
installed into the ranks by tests/nlp/evidence/sitecustomize.py (``PMG_TEST_FLEET_CPU_STANDINS``),
not by the script; Paddle's PyLayers (in-place all-reduce included) run as they are.  The same
sitecustomize writes each rank's evidence (audit, paddle_mgrad's counters, which
paddle_mgrad ran, how often each stand-in ran).
"""

import json
import os
import sys
import zlib  # noqa: F401  (before paddle on 2.6)

import pytest

from script_runs import launch, script_env, switch_on, trainer_args, with_evidence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SCRIPT = os.path.join(ROOT, "tests", "nlp", "llm", "run_pretrain.py")
EVIDENCE = os.path.join(ROOT, "tests", "nlp", "evidence")

# heavy 2-rank launches; one worker runs the module (its one-process references run once)
pytestmark = [pytest.mark.heavy, pytest.mark.xdist_group("llm_script_parallel")]

TIMEOUT = int(os.environ.get("PADDLE_MGRAD_DIST_TIMEOUT", "420"))
TOL = 1e-5
MAX_STEPS, ACCUM, BATCH, LAYERS = 3, 2, 2, 2
MICRO = MAX_STEPS * ACCUM
COLUMN_LINEARS = 5  # llama: q, k, v, gate, up per decoder layer
STEPS = trainer_args(MAX_STEPS, ACCUM, learning_rate="1.0", adam_epsilon="1.0", max_seq_length=64)
MGRAD = [
    "--amp_master_grad",
    "--bf16",
    "--fp16_opt_level",
    "O2",
    "--recompute",
    "true",
    "--recompute_granularity",
    "full",
]
TP2 = ["--tensor_parallel_degree", "2"]

# name -> (model, flags, per-device batch); global batch = BATCH x ACCUM per step everywhere
CONFIGS = {
    "tp2_async": ("llama", TP2 + ["--tensor_parallel_config", "enable_mp_async_allreduce"], BATCH),
    "tp2_async_fused": (
        "llama",
        TP2
        + [
            "--tensor_parallel_config",
            "enable_mp_async_allreduce enable_mp_fused_linear_param_grad_add",
        ],
        BATCH,
    ),
    "tp2_sp": ("llama", TP2 + ["--sequence_parallel", "true"], BATCH),
    "pp2_qwen_hybrid": (
        "qwen",
        ["--pipeline_parallel_degree", "2", "--pp_recompute_interval", "1"],
        BATCH,
    ),
    "pp2_llama": ("llama", ["--pipeline_parallel_degree", "2"], BATCH),
    "sharding1": ("llama", ["--sharding", "stage1", "--sharding_parallel_degree", "2"], BATCH // 2),
}
MODES = ("reentrant", "non_reentrant")

ZLIB_FIRST = """import zlib, os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def save_model(kind, path):
    """A tiny model of ``kind``, seeded, saved with PaddleNLP's save_pretrained (fp32)."""
    import paddle
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM, QWenConfig, QWenForCausalLM

    common = dict(
        vocab_size=384,
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=64,
        seq_length=64,
        use_flash_attention=False,
        use_fused_rms_norm=False,
        use_fused_rope=False,
        dtype="float32",
    )
    paddle.seed(2024)
    if kind == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(intermediate_size=128, num_key_value_heads=4, rms_norm_eps=1e-6, **common)
        )
    else:  # QWen's MLP width is intermediate_size // 2
        model = QWenForCausalLM(
            QWenConfig(
                intermediate_size=256,
                kv_channels=16,
                use_dynamic_ntk=False,
                use_logn_attn=False,
                **common,
            )
        )
    model.save_pretrained(str(path))


def run(tmp, name, kind_dir, flags, mode, nproc, extra_env=None):
    """mode "mgrad": PADDLE_MGRAD=all + CPU fleet stand-ins + evidence; "plain": no
    paddle_mgrad (zlib imported first by a wrapper for Paddle 2.6)."""
    out_dir = tmp / name
    env = script_env()
    script = [SCRIPT]
    if mode == "mgrad":
        with_evidence(env, out_dir / "audit", EVIDENCE)
        switch_on(env, tmp)
        env["PMG_TEST_FLEET_CPU_STANDINS"] = "1"
        env.update(extra_env or {})
    else:
        env.pop("PYTHONPATH", None)
        wrapper = tmp / "zlib_first.py"
        wrapper.write_text(ZLIB_FIRST)
        script = [str(wrapper), SCRIPT]
    argv = [
        *script,
        "--output_dir",
        str(out_dir),
        "--model_name_or_path",
        str(kind_dir),
        "--continue_training",
        "true",
        *STEPS,
        *flags,
    ]
    rc, out = launch(argv, out_dir, nproc, env, TIMEOUT, tmp)
    errors = sorted({ln.strip() for ln in out.splitlines() if "Error: " in ln})
    assert rc == 0, f"{name} exited {rc}: {errors[-6:]}\n{out[-12000:]}"
    return out_dir


def losses(out_dir):
    with open(out_dir / "trainer_state.json") as f:
        return [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """kind -> (saved model dir, losses of the one-process plain run)."""
    cache = {}

    def get(kind):
        if kind not in cache:
            tmp = tmp_path_factory.mktemp(f"ref_{kind}")
            save_model(kind, tmp / "model")
            out = run(
                tmp,
                "plain",
                tmp / "model",
                ["--per_device_train_batch_size", str(BATCH)],
                "plain",
                1,
            )
            cache[kind] = (tmp / "model", losses(out))
            assert len(cache[kind][1]) == MAX_STEPS, cache[kind]
        return cache[kind]

    return get


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_llm_script_two_ranks_match_one_process(config, mode, reference, tmp_path):
    kind, flags, batch = CONFIGS[config]
    model_dir, ref_losses = reference(kind)
    reentrant = "true" if mode == "reentrant" else "false"
    out = run(
        tmp_path,
        config,
        model_dir,
        [
            *MGRAD,
            "--recompute_use_reentrant",
            reentrant,
            "--per_device_train_batch_size",
            str(batch),
            *flags,
        ],
        "mgrad",
        2,
    )
    got = losses(out)
    diffs = [abs(a - b) for a, b in zip(got, ref_losses)]
    audits = [json.load(open(out / "audit" / f"audit.{r}.json")) for r in (0, 1)]
    import paddle

    print(
        f"\nMEASURED llm-script {config} {mode} paddle {paddle.__version__}: losses {got} vs "
        f"one process {ref_losses}; max |loss diff| {max(diffs):.3g}; recompute "
        f"{[a['recompute'] for a in audits]}; stand-ins {[a['fleet_standins'] for a in audits]}"
    )
    assert len(got) == MAX_STEPS and max(diffs) <= TOL, (got, ref_losses)
    for a in audits:
        where = f"{config} {mode} rank {a['rank']}"
        check_rank(config, kind, mode, a, where)


# (budget: 2 decoder layers per micro-step hold about half of no recompute's bytes under full
# recompute already; 0.75 leaves room to keep)
@pytest.mark.parametrize("policy", ["gemm", "save:*Attention", "budget:0.75"])
@pytest.mark.parametrize("config", ["tp2_async", "pp2_qwen_hybrid"])
def test_llm_script_policy(config, policy, reference, tmp_path):
    """``PADDLE_MGRAD_RECOMPUTE_POLICY`` set in the environment, nothing else changed:
    ``gemm`` keeps the linears' outputs from the forward (RowParallelLinear's all-reduced in
    place, so recomputed), ``save:*Attention`` each decoder layer's attention whole (its
    RowParallelLinear all-reduce included), ``budget:0.75`` what its plan chooses (measured,
    agreed in the tensor-parallel group; under the pipeline, per stage); fleet's recompute and
    recompute_hybrid both under it; loss for loss as the one plain process, and GEMMs or
    sublayers spared on every rank."""
    kind, flags, batch = CONFIGS[config]
    model_dir, ref_losses = reference(kind)
    out = run(
        tmp_path,
        config,
        model_dir,
        [
            *MGRAD,
            "--recompute_use_reentrant",
            "false",
            "--per_device_train_batch_size",
            str(batch),
            *flags,
        ],
        "mgrad",
        2,
        {"PADDLE_MGRAD_RECOMPUTE_POLICY": policy},
    )
    got = losses(out)
    diffs = [abs(a - b) for a, b in zip(got, ref_losses)]
    audits = [json.load(open(out / "audit" / f"audit.{r}.json")) for r in (0, 1)]
    import paddle

    print(
        f"\nMEASURED llm-script {config} {policy} policy paddle {paddle.__version__}: max |loss "
        f"diff| {max(diffs):.3g}; policy {[a['policy'] for a in audits]}"
    )
    assert len(got) == MAX_STEPS and max(diffs) <= TOL, (got, ref_losses)
    for a in audits:
        where = f"{config} {policy} rank {a['rank']}"
        check_rank(config, kind, "non_reentrant", a, where)
        g = a["policy"].get(policy, {})
        blocks = a["recompute"]["recomputations"]
        whole = g.get("blocks_kept_whole", 0)  # (a budget: step's last block: not recomputed)
        assert g.get("calls") == g.get("replays") + whole, (where, a["policy"])
        assert g.get("replays") == blocks > 0, (where, a["policy"])
        spared = {
            "gemm": ("gemms_not_recomputed",),
            "save": ("sublayers_not_recomputed",),
            "budget": ("gemms_not_recomputed", "sublayers_not_recomputed"),
        }[policy.split(":")[0]]
        if policy.startswith("budget:"):  # a plan for this rank's decoder layers, followed:
            # candidates spared in the replays, or the step's last block not replayed (a stage
            # that back-propagates its last block first; under 1F1B the last stage)
            plans = a["plans"][policy]
            assert plans and all(p["chosen"] or p["last_block"] for p in plans.values()), (
                where,
                plans,
            )
            if not any(p["chosen"] for p in plans.values()):
                continue
        assert sum(g.get(s, 0) for s in spared) > 0, (where, a["policy"])


def check_rank(config, kind, mode, a, where):
    # the checkout under test ran in the ranks (not another install)
    assert os.path.dirname(os.path.dirname(a["paddle_mgrad_file"])) == ROOT, (where, a)
    s = a["audit"]
    assert s["trainable"] == s["received_grad"] == s["in_fp32_main_grad"] > 0, (where, s)
    assert s["grads_per_param"] == [MICRO, MICRO], (where, s)  # once per micro-step
    assert s["grad_not_none"] == 0 and s["missing"] == [], (where, s)
    assert a["main_grad_dtypes"] == ["paddle.float32"], where
    rc, lin, st = a["recompute"], a["linear"], a["fleet_standins"]
    # (blocks a budget: policy kept whole -- a step's last, its measured steps' -- were called,
    # not recomputed)
    whole = sum(p.get("blocks_kept_whole", 0) for p in a.get("policy", {}).values())
    assert lin["into_main_grad"] > 0, (where, lin)
    if config == "pp2_qwen_hybrid":
        # fleet's recompute_hybrid (PipelineLayer, pp_recompute_interval=1), whatever the flag
        assert a["model_class"] == "QWenForCausalLMPipe", where
        assert rc["hybrid"] > 0 and rc["hybrid"] % MICRO == 0, (where, rc)
        assert rc["recomputations"] == rc["hybrid"] - whole, (where, rc)
        assert rc["non_reentrant"] == rc["reentrant"] == 0, (where, rc)
    else:
        layers = LAYERS // 2 if config == "pp2_llama" else LAYERS
        assert rc[mode] == layers * MICRO, (where, rc)
        assert rc["recomputations"] == layers * MICRO - whole, (where, rc)
        assert rc["hybrid"] == 0, (where, rc)
    if config.startswith("pp2"):
        assert st.get("send_on_calc_stream", 0) > 0 and st.get("recv_on_calc_stream", 0) > 0, where
    if config.startswith("tp2"):
        # Paddle's own in-place mp_allreduce_eager (RowParallelLinear, VocabParallelEmbedding)
        assert st.get("all_reduce_on_calc_stream", 0) > 0, (where, st)
        assert st.get("c_softmax_with_cross_entropy", 0) == MICRO, (where, st)
        assert (
            "RowParallelLinear" in a["layer_types"]
            or "RowSequenceParallelLinear" in a["layer_types"]
        ), where
    if config in ("tp2_async", "tp2_async_fused"):
        assert "ColumnParallelLinear" in a["layer_types"], where
        assert lin["overlap_backward"] == COLUMN_LINEARS * LAYERS * MICRO, (where, lin)
    else:
        assert lin["overlap_backward"] == 0, (where, lin)
    if config == "tp2_sp":
        assert "ColumnSequenceParallelLinear" in a["layer_types"], where
        assert st.get("reduce_scatter_tensor", 0) > 0, (where, st)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
