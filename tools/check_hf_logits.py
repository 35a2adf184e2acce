#!/usr/bin/env python3
"""Cross-check moetrain's Qwen3-MoE forward against Hugging Face transformers.

Run on a machine with torch + transformers (never a moetrain dependency):
    python3 tools/check_hf_logits.py --moetrain build/moetrain [--work /tmp/hfcheck]

For each case it builds a random tiny Qwen3MoeForCausalLM in float32 with transformers,
saves it with save_pretrained, scores the same random tokens with transformers and with
`moetrain score` (CPU, f32), and compares logits and loss (relative error < 1e-4). It then
converts the folder to a moetrain checkpoint and back (`moetrain convert`), checks that every
tensor of the round trip is bitwise equal to the original, that transformers loads the
exported folder, and that moetrain scores the moetrain checkpoint the same.
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
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

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


def check_case(name, cfg_kwargs, moetrain, work, seed):
    ok = True
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**cfg_kwargs)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms are ones at init: make them random so they are tested too
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hf_dir = os.path.join(work, name, "hf")
    shutil.rmtree(os.path.join(work, name), ignore_errors=True)
    model.save_pretrained(hf_dir, safe_serialization=True)
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

    reloaded = Qwen3MoeForCausalLM.from_pretrained(back_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        e = rel_err(reloaded(input_ids=ids).logits[0].float(), hf_logits)
    ok &= e == 0.0
    print(f"[{name}] transformers loads the exported folder: logits rel err {e:.3e} {'ok' if e == 0.0 else 'FAIL'}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moetrain", required=True)
    ap.add_argument("--work", default="/tmp/hfcheck")
    args = ap.parse_args()
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
                tie_word_embeddings=False, output_router_logits=False, attention_bias=False)
    cases = [
        ("moe", base, 1),
        ("dense-first-tied-unnormed", dict(base, mlp_only_layers=[0], tie_word_embeddings=True,
                                           norm_topk_prob=False, num_experts_per_tok=3), 2),
    ]
    ok = True
    for name, kw, seed in cases:
        ok &= check_case(name, kw, args.moetrain, args.work, seed)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
