#!/usr/bin/env python3
"""Cross-check moetrain's Qwen3-MoE and DeepSeek-V3 forwards against Hugging Face transformers.

Run on a machine with torch + transformers (never a moetrain dependency):
    python3 tools/check_hf_logits.py --moetrain build/moetrain [--work /tmp/hfcheck]
        [--family qwen3_moe|deepseek_v3|all]

For each case it builds a random tiny Qwen3MoeForCausalLM (or DeepseekV3ForCausalLM) in
float32 with transformers,
saves it with save_pretrained, scores the same random tokens with transformers and with
`moetrain score` (CPU, f32), and compares logits and loss (relative error < 1e-4). It then
converts the folder to a moetrain checkpoint and back (`moetrain convert`), checks that every
tensor of the round trip is bitwise equal to the original, that transformers loads the
exported folder, and that moetrain scores the moetrain checkpoint the same.

The cases are chosen so that a config key moetrain fails to read shows: every value differs
from moetrain's default and from transformers' (booleans take each value in some case),
head_dim is not hidden_size / num_attention_heads, and the same weights are scored under
config.json files in both spellings: as the installed transformers writes it (5.x:
num_local_experts, rope_parameters, dtype), rewritten by hand in the older spelling of
published checkpoints (num_experts, rope_theta, torch_dtype, rope_scaling null), and with
keys omitted so that transformers' defaults apply (transformers reloads each rewritten folder
first, to prove the file means the same model to it). Last, a config with a key moetrain does
not know must be refused, naming the key.

DeepSeek-V3's cases: with and without the query latent (q_lora_rank null), dense first
layers, group-limited routing (and one group), YaRN (and the default rope), interleaved
rotary pairs (and not), shared experts, a random e_score_correction_bias, every value apart
from moetrain's defaults and transformers'; one more folder rewrites config.json in DeepSeek's
own spelling (rope_scaling with "type", rope_theta at the top, scoring_func, topk_method,
moe_layer_freq, num_nextn_predict_layers, ep_size, aux_loss_alpha, seq_aux).
Prints one line per check and PASS/FAIL at the end; exits non-zero on failure.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

FAMILIES = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
            "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM)}

TOL = 1e-4


def rel_err(a, b):
    a = a.double()
    b = b.double()
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def folder_tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print("command failed:", " ".join(cmd), "\n", r.stdout, r.stderr)
        raise SystemExit(1)
    return r.stdout


def rewrite_config(hf_dir, how):
    """Rewrites hf_dir/config.json: 'old' = the older spelling, 'omit' = also without the keys
    whose value is transformers' default (norm_topk_prob false, head_dim = hidden / heads, ...)."""
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        j = json.load(f)
    if how == "deepseek":  # DeepSeek's own config.json (DeepSeek-V3's on the Hub)
        rope = j.pop("rope_parameters")
        j["rope_theta"] = rope.pop("rope_theta")
        kind = rope.pop("rope_type", "default")
        j["rope_scaling"] = dict(rope, type=kind) if kind != "default" else None
        j.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, num_nextn_predict_layers=0,
                 ep_size=1, aux_loss_alpha=0.001, seq_aux=True)
        j["torch_dtype"] = j.pop("dtype", "float32")
    if how in ("old", "omit"):
        j["num_experts"] = j.pop("num_local_experts")
        rope = j.pop("rope_parameters")
        assert rope.get("rope_type", "default") == "default", rope
        j["rope_theta"] = rope["rope_theta"]
        j["rope_scaling"] = None
        j["torch_dtype"] = j.pop("dtype", "float32")
        j["transformers_version"] = "4.51.0"
    if how == "omit":
        defaults = dict(norm_topk_prob=False, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                        rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False)
        for k, v in defaults.items():
            if j.get(k) == v:
                del j[k]
        if j.get("head_dim") == j["hidden_size"] // j["num_attention_heads"]:
            del j["head_dim"]
    with open(path, "w") as f:
        json.dump(j, f, indent=2)
    return sorted(j)


def check_case(family, name, cfg_kwargs, moetrain, work, seed, rewrite=None):
    ok = True
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = config_cls(**cfg_kwargs)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # norms are ones at init: make them random so they are tested too
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for n, b in model.named_buffers():  # DeepSeek's routing bias starts at zero: random
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    hf_dir = os.path.join(work, name, "hf")
    shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    model.save_pretrained(hf_dir, safe_serialization=True)
    if rewrite:
        keys = rewrite_config(hf_dir, rewrite)
        print(f"[{name}] config.json rewritten ({rewrite}): {keys}")
        with torch.no_grad():  # the rewritten file is the same model to transformers
            again = model_cls.from_pretrained(hf_dir, dtype=torch.float32).eval()
            e = rel_err(again(input_ids=torch.arange(16)[None] % cfg.vocab_size).logits,
                        model(input_ids=torch.arange(16)[None] % cfg.vocab_size).logits)
        ok &= e == 0.0
        print(f"[{name}] transformers reloads the rewritten folder: logits rel err {e:.3e} {'ok' if e == 0.0 else 'FAIL'}")
    else:
        with open(os.path.join(hf_dir, "config.json")) as f:
            print(f"[{name}] config.json as transformers wrote it: {sorted(json.load(f))}")
    keys = sorted(folder_tensors(hf_dir).keys())
    fused = any(k.endswith("experts.gate_up_proj") or "gate_up_proj" in k for k in keys)
    print(f"[{name}] saved {len(keys)} tensors ({'fused' if fused else 'per-expert'} experts), e.g. {keys[:3]}")

    ids = torch.randint(0, cfg.vocab_size, (1, 96), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    hf_logits = out.logits[0].float()
    hf_loss = out.loss.item()
    tok_file = os.path.join(work, name, "tokens.json")
    with open(tok_file, "w") as f:
        json.dump(ids[0].tolist(), f)

    def score(model_dir, tag):
        nonlocal ok
        logits_file = os.path.join(work, name, f"logits-{tag}.safetensors")
        res = json.loads(run([moetrain, "score", "--model", model_dir, "--tokens-file", tok_file, "--out", logits_file]))
        mt_logits = load_file(logits_file)["logits"]
        e_logits = rel_err(mt_logits, hf_logits)
        e_loss = abs(res["loss"] - hf_loss) / abs(hf_loss)
        good = e_logits < TOL and e_loss < TOL
        ok &= good
        print(f"[{name}] {tag}: logits rel err {e_logits:.3e}, loss moetrain {res['loss']:.7f} vs transformers "
              f"{hf_loss:.7f} (rel err {e_loss:.3e}) {'ok' if good else 'FAIL'}")

    score(hf_dir, "hf-folder")
    mt_dir = os.path.join(work, name, "moetrain")
    back_dir = os.path.join(work, name, "hf-back")
    run([moetrain, "convert", hf_dir, mt_dir])
    run([moetrain, "convert", mt_dir, back_dir])
    score(mt_dir, "moetrain-checkpoint")

    # Round trip: the exported tensors are the originals (per-expert names when the source
    # was fused), bit for bit.
    orig = folder_tensors(hf_dir)
    back = folder_tensors(back_dir)
    if fused:
        split = {}
        for k, v in orig.items():
            if k.endswith("mlp.experts.gate_up_proj"):
                base = k[: -len("gate_up_proj")]
                half = v.shape[1] // 2
                for e in range(v.shape[0]):
                    split[f"{base}{e}.gate_proj.weight"] = v[e, :half]
                    split[f"{base}{e}.up_proj.weight"] = v[e, half:]
            elif k.endswith("mlp.experts.down_proj"):
                base = k[: -len("down_proj")]
                for e in range(v.shape[0]):
                    split[f"{base}{e}.down_proj.weight"] = v[e]
            else:
                split[k] = v
        orig = split
    same = set(orig) == set(back) and all(torch.equal(orig[k], back[k]) for k in orig)
    ok &= same
    print(f"[{name}] round trip HF -> moetrain -> HF: {len(back)} tensors {'bitwise equal' if same else 'DIFFER'}")

    reloaded = model_cls.from_pretrained(back_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        e = rel_err(reloaded(input_ids=ids).logits[0].float(), hf_logits)
    ok &= e == 0.0
    print(f"[{name}] transformers loads the exported folder: logits rel err {e:.3e} {'ok' if e == 0.0 else 'FAIL'}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moetrain", required=True)
    ap.add_argument("--work", default="/tmp/hfcheck")
    ap.add_argument("--family", default="all", choices=["all", *FAMILIES])
    args = ap.parse_args()
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    # moetrain's defaults: vocab 257, hidden 128, intermediate 256, moe 128, 4 layers, 4 heads,
    # 2 kv heads, head_dim 32, 8 experts, top-2, norm_topk true, sparse step 1, no dense layers,
    # theta 1e4, eps 1e-6, untied, 4096 positions, aux 0.001. transformers': vocab 151936,
    # hidden 2048, ..., 128 experts, top-8, norm_topk false, theta 1e4, eps 1e-6, untied.
    a = dict(vocab_size=384, hidden_size=96, intermediate_size=160, moe_intermediate_size=40,
             num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3, head_dim=24,
             num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1,
             mlp_only_layers=[0], rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=777,
             tie_word_embeddings=True, router_aux_loss_coef=0.004, initializer_range=0.05)
    b = dict(vocab_size=300, hidden_size=80, intermediate_size=112, moe_intermediate_size=24,
             num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=28,
             num_experts=5, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=2,
             mlp_only_layers=[], rope_theta=2.5e4, rms_norm_eps=3e-6, max_position_embeddings=900,
             tie_word_embeddings=False, router_aux_loss_coef=0.02, initializer_range=0.04)
    cases = [
        ("qwen3_moe", "t5-written-a", a, 1, None),
        ("qwen3_moe", "t5-written-b", b, 2, None),
        ("qwen3_moe", "old-spelling-a", a, 3, "old"),
        ("qwen3_moe", "old-spelling-b-defaults-omitted", b, 4, "omit"),
        ("qwen3_moe", "old-spelling-c-head-dim-omitted", dict(b, hidden_size=72, num_attention_heads=3, head_dim=24,
                                                              num_experts=7, num_experts_per_tok=1), 5, "omit"),
    ]
    # DeepSeek-V3. moetrain's defaults: vocab 257, hidden 64, intermediate 128, moe 32, 3 layers,
    # 4 heads, q_lora 48, kv_lora 32, nope 16, rope 8, v 16, 8 experts in 4 groups keep 2, top-2,
    # 1 shared, 1 dense layer, scaling 2.5, norm_topk true, interleave true, yarn x4 over 1024
    # (beta 32/1, mscale 1/1), theta 1e4, eps 1e-6, untied, 4096 positions. transformers':
    # DeepSeek-V3's full size (q_lora 1536, kv_lora 512, 128/64/128, 256 experts in 8 groups
    # keep 4, top-8, 3 dense layers, ...), theta 1e4, no rope scaling.
    da = dict(vocab_size=311, hidden_size=96, intermediate_size=144, moe_intermediate_size=40,
              num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=36, kv_lora_rank=24,
              qk_nope_head_dim=10, qk_rope_head_dim=12, v_head_dim=20, n_routed_experts=12, n_group=3,
              topk_group=2, num_experts_per_tok=3, n_shared_experts=2, first_k_dense_replace=2,
              routed_scaling_factor=1.7, norm_topk_prob=False, rope_interleave=False,
              rope_parameters=dict(rope_type="yarn", rope_theta=2e4, factor=8.0, original_max_position_embeddings=40,
                                   beta_fast=24.0, beta_slow=2.0, mscale=0.9, mscale_all_dim=0.8),
              max_position_embeddings=640, rms_norm_eps=2e-6, tie_word_embeddings=True, initializer_range=0.05)
    db = dict(vocab_size=280, hidden_size=80, intermediate_size=112, moe_intermediate_size=28,
              num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=5, q_lora_rank=None, kv_lora_rank=20,
              qk_nope_head_dim=18, qk_rope_head_dim=6, v_head_dim=14, n_routed_experts=10, n_group=1,
              topk_group=1, num_experts_per_tok=4, n_shared_experts=3, first_k_dense_replace=0,
              routed_scaling_factor=0.8, norm_topk_prob=True, rope_interleave=True,
              rope_parameters=dict(rope_type="default", rope_theta=5e4),
              max_position_embeddings=500, rms_norm_eps=4e-6, tie_word_embeddings=False, initializer_range=0.06)
    cases += [
        ("deepseek_v3", "dsv3-qlora-yarn-groups-dense", da, 11, None),
        ("deepseek_v3", "dsv3-direct-q-default-rope-one-group", db, 12, None),
        ("deepseek_v3", "dsv3-interleaved-yarn-deepseek-spelling",
         dict(da, rope_interleave=True, norm_topk_prob=True, tie_word_embeddings=False, first_k_dense_replace=1), 13,
         "deepseek"),
    ]
    ok = True
    for family, name, kw, seed, rewrite in cases:
        if args.family in ("all", family):
            ok &= check_case(family, name, kw, args.moetrain, args.work, seed, rewrite)

    if args.family == "deepseek_v3":
        print("PASS" if ok else "FAIL")
        sys.exit(0 if ok else 1)
    # A key moetrain does not know is refused, naming it, rather than skipped.
    bad_dir = os.path.join(args.work, "unknown-key")
    shutil.rmtree(bad_dir, ignore_errors=True)
    shutil.copytree(os.path.join(args.work, "t5-written-a", "hf"), bad_dir)
    with open(os.path.join(bad_dir, "config.json")) as f:
        j = json.load(f)
    j["moe_layer_freq"] = 2
    with open(os.path.join(bad_dir, "config.json"), "w") as f:
        json.dump(j, f)
    tok_file = os.path.join(args.work, "t5-written-a", "tokens.json")
    r = subprocess.run([args.moetrain, "score", "--model", bad_dir, "--tokens-file", tok_file],
                       capture_output=True, text=True)
    refused = r.returncode != 0 and "moe_layer_freq" in r.stderr
    ok &= refused
    print(f"[unknown-key] moetrain score refuses a config with \"moe_layer_freq\": "
          f"{'ok' if refused else 'FAIL'} ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'no error'})")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
