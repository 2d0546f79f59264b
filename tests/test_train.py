"""Drafter training on a tiny target: loss goes down, the training forward equals the inference
forward, export -> load keeps the drafter's outputs."""
import json
import math

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.models.dflash import DFlashDrafter
from tiny import tiny_model
from ddtree.train.trainer import (TrainConfig, drafter_train_logits_hidden, export_drafter, new_drafter,
                                  next_token_probs, target_features, train_drafter)


def tiny_target(vocab=32):
    return tiny_model("qwen3", vocab=vocab, layers=4, std=0.3)


def write_sequences(path, n=64, vocab=32):
    """Sequences that count upwards mod vocab from a random start: easy to learn."""
    gen = torch.Generator().manual_seed(0)
    seqs, prompt_lens = [], []
    for _ in range(n):
        start = int(torch.randint(vocab, (), generator=gen))
        length = int(torch.randint(20, 40, (), generator=gen))
        seqs.append(torch.tensor([(start + i) % vocab for i in range(length)], dtype=torch.int32))
        prompt_lens.append(4)
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    torch.save({"tokens": torch.cat(seqs), "offsets": offsets, "prompt_lens": prompt_lens, "done": n}, path)


def test_training_lowers_loss_and_exports(tmp_path):
    target = tiny_target()
    write_sequences(tmp_path / "responses.pt")
    cfg = TrainConfig(num_layers=1, num_taps=2, block_size=4, steps=100, batch_size=8, anchors=8, max_len=64,
                      lr=1e-2)
    # Two pieces with a resume in between, like a long run split by time limits.
    first = train_drafter(target, tmp_path / "responses.pt", tmp_path / "run", TrainConfig(**{**cfg.__dict__}),
                          log_every=10, max_minutes=0)  # stops at once: only checkpoints step 0
    assert first["step"] == 0
    out = train_drafter(target, tmp_path / "responses.pt", tmp_path / "run", cfg, log_every=10)
    assert out["done"] and out["step"] == 100
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.7 * log[0]["loss"]
    assert log[-1]["acc_by_depth"][0] > log[0]["acc_by_depth"][0] + 0.3

    export_drafter(tmp_path / "run", tmp_path / "export", dtype=torch.float32)
    cfg_json = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg_json["architectures"] == ["DFlashDraftModel"] and (tmp_path / "export" / "mask_embedding.pt").exists()
    drafter = DFlashDrafter.from_pretrained(tmp_path / "export")
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, ckpt["model"][k]), k

    # --init continues from the export: same weights at step 0 (fresh optimizer), shape taken from it.
    again = TrainConfig(num_layers=3, steps=10, batch_size=8, anchors=8, max_len=64, init=str(tmp_path / "export"))
    train_drafter(target, tmp_path / "responses.pt", tmp_path / "run2", again, max_minutes=0)
    ckpt2 = torch.load(tmp_path / "run2" / "checkpoint.pt", weights_only=False)
    assert ckpt2["train_config"]["num_layers"] == 1
    assert ckpt2["train_config"]["num_taps"] == len(drafter.config.target_layer_ids)
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, ckpt2["model"][k]), k
    with pytest.raises(ValueError, match="vocab_size"):
        train_drafter(tiny_target(vocab=48), tmp_path / "responses.pt", tmp_path / "run3", again, max_minutes=0)

    # The trained drafter drives DDTree: long acceptance on the pattern, output unchanged.
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ar = LLM(target=target, method="ar", device="cpu", max_model_len=64, kv_cache_gb=0.01).generate(prompt, params)[0]
    dd = LLM(target=target, drafter=drafter, method="ddtree", budget=6, device="cpu", max_model_len=64,
             kv_cache_gb=0.01).generate(prompt, params)[0]
    assert dd.token_ids == ar.token_ids
    # The engine froze both models: its steps build no autograd graph, so the (backward-less)
    # Triton kernels stay on for them on CUDA even outside inference_mode (graph capture).
    assert not any(p.requires_grad for m in (target, drafter) for p in m.parameters())


def test_training_forward_equals_inference_forward():
    """The masked training forward of one block = the engine's drafter step on the same prefix."""
    target = tiny_target()
    drafter = new_drafter(target, TrainConfig(num_layers=2, num_taps=2, block_size=4, seed=1))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    drafter.eval()
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    llm = LLM(target=target, drafter=drafter, method="ddtree", budget=4, device="cpu", max_model_len=64,
              kv_cache_gb=0.01)
    s = llm.engine.add_request(seq, SamplingParams(temperature=0, max_tokens=1))
    llm.engine.step()  # prefill of seq[:-1]; seq[-1] is the root
    with torch.no_grad():
        inference = llm.engine.runner.draft_for([s])[0]
        ids = torch.tensor([seq + [0, 0, 0]])
        _, tapped = target_features(target, ids, drafter.taps)
        anchors = torch.tensor([[len(seq) - 1, 2]])  # a second block must not disturb the first
        embeds = target.embed(ids[:, anchors[0]])[:, :, None].expand(-1, -1, 4, -1).clone()
        embeds[:, :, 1:] = drafter.mask_embedding
        hidden = drafter_train_logits_hidden(drafter, tapped, embeds, anchors, torch.tensor([len(seq) + 3]))
        training = torch.log_softmax(target.logits(hidden[0, 0, 1:]), -1)
    assert torch.allclose(inference, training, atol=1e-5), float((inference - training).abs().max())


def test_distillation_labels_are_the_targets_next_token_distribution():
    """At label position p the soft label is the target's distribution for token p given tokens
    < p: the last position of a forward over the prefix alone, whatever follows it or pads the
    batch."""
    target = tiny_target()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(32, (2, 12), generator=gen)
    ids[1, 9:] = 0  # the second row is 9 tokens long, right-padded
    hidden, _ = target_features(target, ids, (1,))
    label_pos = torch.tensor([[3, 7, 11], [1, 5, 8]])
    probs = next_token_probs(target, hidden, label_pos)
    assert probs.shape == (2, 3, 32)
    for b in range(2):
        for j, pos in enumerate(label_pos[b].tolist()):
            prefix, _ = target_features(target, ids[b:b + 1, :pos], (1,))
            expected = torch.softmax(target.logits(prefix[0, -1]), -1)
            assert torch.allclose(probs[b, j], expected, atol=1e-6), (b, pos)


def test_distillation_lowers_the_kl_to_the_target(tmp_path):
    """distill=1 trains towards the target's distribution (here not the counting labels, which
    plain cross-entropy follows away from it); two response files are read as one set."""
    target = tiny_target()
    write_sequences(tmp_path / "a.pt", n=32)
    write_sequences(tmp_path / "b.pt", n=32)
    kl = {}
    for distill in (1.0, 1e-4):  # the second barely weighs the target's distribution
        cfg = TrainConfig(num_layers=1, num_taps=2, block_size=4, steps=60, batch_size=8, anchors=8,
                          max_len=64, lr=1e-2, distill=distill)
        train_drafter(target, [tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / f"run{distill}", cfg, log_every=10)
        log = [json.loads(line) for line in (tmp_path / f"run{distill}" / "train_log.jsonl").read_text().splitlines()]
        assert {"ce", "kl"} <= log[0].keys()
        kl[distill] = (log[0]["kl"], log[-1]["kl"])
    assert kl[1.0][1] < 0.75 * kl[1.0][0], kl
    assert kl[1e-4][1] > 1.5 * kl[1.0][1], kl
    with pytest.raises(ValueError, match="distill"):
        train_drafter(target, tmp_path / "a.pt", tmp_path / "bad", TrainConfig(distill=1.5), max_minutes=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_generation_passes_are_seeded(tmp_path, smol_dir, device, monkeypatch):
    """A second sampling pass over the same prompts with another seed gives other responses; the
    same seed gives the same ones (so a pass can be rerun). The engine itself gets the seed: on
    CUDA its sampler draws its seed when it is built, and seeding torch after that gave every pass
    the same responses (phases 6 and 7 of the drafter)."""
    from ddtree.train import generate
    engine_seeds = []
    engine = generate.LLM
    monkeypatch.setattr(generate, "LLM", lambda *a, **kw: engine_seeds.append(kw.get("seed")) or engine(*a, **kw))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": text}]})
                                 for text in ("Name a colour.", "Count to three.")))
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        stats = generate.generate_responses(prompts, tmp_path / f"{name}.pt", target=smol_dir, max_new_tokens=6,
                                            temperatures=(1.0,), seed=seed, device=device, kv_cache_gb=0.05,
                                            max_num_seqs=2)
        assert stats["sequences"] == 2
        runs[name] = torch.load(tmp_path / f"{name}.pt")["tokens"]
    assert engine_seeds == [1, 1, 2]
    assert torch.equal(runs["a"], runs["b"])
    assert not torch.equal(runs["a"], runs["c"])


def test_long_conversations_lose_their_oldest_pairs_first():
    from ddtree.train.generate import prompt_within, prompts_within

    def one_token_per_char(conversations):  # stands in for LLM.apply_chat_templates
        return [[ord(c) for m in messages for c in "|" + m["content"]] for messages in conversations]

    def ids(messages):
        return one_token_per_char([messages])[0]

    conv = [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 10},
            {"role": "user", "content": "c" * 10}, {"role": "assistant", "content": "d" * 10},
            {"role": "user", "content": "last turn"}]
    assert prompt_within(one_token_per_char, conv, 100) == ids(conv)
    assert prompt_within(one_token_per_char, conv, 35) == ids(conv[2:])  # 54 tokens, then 32, then 10
    assert prompt_within(one_token_per_char, conv, 12) == ids(conv[4:])
    assert prompt_within(one_token_per_char, conv, 5) == ids(conv[4:])[:5]  # a single turn is cut at its end
    # a chunk: only the conversation over the limit loses pairs, the others stay as templated
    short = [{"role": "user", "content": "hi"}]
    assert prompts_within(one_token_per_char, [short, conv, short], 35) == [ids(short), ids(conv[2:]), ids(short)]


def test_packed_responses_unpack_to_the_same_pass(tmp_path, smol_dir, monkeypatch):
    """A pass packed without its prompts (to bring it back from a device call and train on it
    again later) unpacks to the same .pt, its prompts templated again; another prompts file,
    another order or a prompt cut elsewhere is refused, not silently paired with wrong answers."""
    from ddtree.train import generate
    prompts = tmp_path / "prompts.jsonl"
    convs = [[{"role": "user", "content": "Name a colour."}],
             [{"role": "user", "content": "x " * 1200}, {"role": "assistant", "content": "ok"},
              {"role": "user", "content": "Count to three."}],  # over the limit: loses its first pair
             [{"role": "user", "content": "Write a haiku about tea."}]]
    prompts.write_text("\n".join(json.dumps({"messages": c}) for c in convs))
    # a pass over the first 2 of the 3 prompts (a pass cut by its time limit covers the file's first ones)
    stats = generate.generate_responses(prompts, tmp_path / "pass.pt", target=smol_dir, max_new_tokens=6,
                                        temperatures=(1.0,), seed=3, device="cpu", kv_cache_gb=0.05,
                                        max_num_seqs=2, max_prompts=2)
    assert stats["sequences"] == 2
    original = torch.load(tmp_path / "pass.pt")
    assert original["prompt_limit"] == 1024 - 6 - 1 and original["prompt_lens"][1] < 100
    packed = generate.pack_responses(tmp_path / "pass.pt", tmp_path / "pass.rsp")
    assert packed["sequences"] == 2 and packed["response_tokens"] == stats["generated_tokens"]
    generate.unpack_responses(tmp_path / "pass.rsp", prompts, tmp_path / "again.pt", target=smol_dir)
    again = torch.load(tmp_path / "again.pt")
    assert torch.equal(again["tokens"], original["tokens"])
    assert [again[k] for k in ("offsets", "prompt_lens", "done")] == [original[k] for k in ("offsets", "prompt_lens", "done")]
    # the unpacked pass resumes like any other: finished for its 2 prompts (no target loaded),
    # then the third prompt appended; another prompt limit would not fit it
    real_llm = generate.LLM
    monkeypatch.setattr(generate, "LLM", lambda *a, **k: pytest.fail("a finished pass loaded the target"))
    assert generate.generate_responses(prompts, tmp_path / "again.pt", target=smol_dir, max_new_tokens=6,
                                       max_prompts=2)["sequences"] == 2
    with pytest.raises(ValueError, match="cut at 1017 tokens; --max-new-tokens 8 would cut them at 1015"):
        generate.generate_responses(prompts, tmp_path / "again.pt", target=smol_dir, max_new_tokens=8)
    monkeypatch.setattr(generate, "LLM", real_llm)
    more = generate.generate_responses(prompts, tmp_path / "again.pt", target=smol_dir, max_new_tokens=6,
                                       temperatures=(1.0,), seed=3, device="cpu", kv_cache_gb=0.05, max_num_seqs=2)
    assert more["sequences"] == 3
    assert torch.equal(torch.load(tmp_path / "again.pt")["tokens"][:len(original["tokens"])], original["tokens"])
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("\n".join(json.dumps({"messages": c}) for c in [convs[0], convs[2], convs[1]]))
    with pytest.raises(ValueError, match="are not those the responses answered"):
        generate.unpack_responses(tmp_path / "pass.rsp", reordered, tmp_path / "bad.pt", target=smol_dir)
    with pytest.raises(ValueError, match="has 1 prompts"):
        one = tmp_path / "one.jsonl"
        one.write_text(json.dumps({"messages": convs[0]}))
        generate.unpack_responses(tmp_path / "pass.rsp", one, tmp_path / "bad.pt", target=smol_dir)
    with pytest.raises(ValueError, match="not a packed responses file"):
        import lzma
        with lzma.open(tmp_path / "other.rsp", "wb") as f:
            f.write(b'{"format": "something else"}\n')
        generate.unpack_responses(tmp_path / "other.rsp", prompts, tmp_path / "bad.pt", target=smol_dir)
    (tmp_path / "plain.txt").write_text("not lzma")
    with pytest.raises(ValueError, match="not a packed responses file"):
        generate.unpack_responses(tmp_path / "plain.txt", prompts, tmp_path / "bad.pt", target=smol_dir)
    from ddtree.train.cli import _pack
    with pytest.raises(SystemExit, match="error: .*missing.pt"):
        _pack(type("Args", (), {"data": tmp_path / "missing.pt", "out": tmp_path / "x.rsp"})())


def test_batched_chat_templates_equal_one_at_a_time(smol, tokenizer):
    """generate templates a chunk in one tokenizer call: the ids must be the tokenizer's own,
    conversation by conversation (multi-turn, system, non-ASCII, whitespace at the edges)."""
    from conftest import make_llm
    llm = make_llm(smol, tokenizer, method="ar")
    convs = [[{"role": "user", "content": "Name a colour."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  2+2?\n"}],
             [{"role": "user", "content": "Übersetze: café"}, {"role": "assistant", "content": "coffee"},
              {"role": "user", "content": "Und 'thé'? 日本語も"}]]
    one_by_one = []
    for c in convs:
        ids = tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
        one_by_one.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert llm.apply_chat_templates(convs) == one_by_one
    assert [llm.apply_chat_template(c) for c in convs] == one_by_one
    assert len({len(x) for x in one_by_one}) == 3  # unpadded: the lengths differ
    assert llm.apply_chat_templates([]) == []
    with pytest.raises(ValueError, match="role"):
        llm.apply_chat_templates([convs[0], [{"role": "user"}]])


def test_time_based_schedule_ends_the_run_at_its_minutes(tmp_path):
    """--minutes: the cosine follows training time summed over resumes, and the run ends there
    whatever the step rate; a resume may be given more minutes, as with --steps."""
    target = tiny_target()
    write_sequences(tmp_path / "responses.pt")
    cfg = dict(num_layers=1, num_taps=2, block_size=4, steps=10**6, batch_size=2, anchors=4, max_len=64, lr=1e-2,
               warmup=0.1)
    ticks = iter(range(10**6))
    clock = lambda: float(next(ticks))  # one second per reading: one reading per step

    def log_lrs():
        return [json.loads(line)["lr"] for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]

    out = train_drafter(target, tmp_path / "responses.pt", tmp_path / "run", TrainConfig(**cfg, minutes=0.5),
                        log_every=1, now=clock)
    assert out["done"] and out["step"] == 30 and out["minutes"] >= 0.5
    lrs = log_lrs()
    peak = lrs.index(max(lrs))
    assert peak == 2 and max(lrs) > 0.99e-2  # warm-up over 3 of the 30 seconds, then the cosine
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])) and lrs[-1] == 0.0
    assert lrs[14] == pytest.approx(0.5e-2 * (1 + math.cos(math.pi * (15 / 30 - 0.1) / 0.9)), rel=1e-6)

    # A resume given 1 minute in all continues the cosine from where the first call stopped (31 s:
    # the reading at the save counts too) to 60 s, one step per second.
    # Logged every 7 steps here: the result still counts every step (59, the last logged is 56).
    more = train_drafter(target, tmp_path / "responses.pt", tmp_path / "run", TrainConfig(**cfg, minutes=1.0),
                         log_every=7, now=clock)
    assert more["done"] and more["step"] == 59
    lrs = log_lrs()[30:]
    assert lrs[0] == pytest.approx(0.5e-2 * (1 + math.cos(math.pi * (36 / 60 - 0.1) / 0.9)), rel=1e-6)  # step 35
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 59 and ckpt["optimizer"]["param_groups"][0]["lr"] == 0.0
    with pytest.raises(ValueError, match="minutes"):
        train_drafter(target, tmp_path / "responses.pt", tmp_path / "run4", TrainConfig(**cfg, minutes=0))


def test_train_cli_rejects_nonpositive_minutes_before_loading(tmp_path):
    from ddtree.cli import main
    with pytest.raises(SystemExit, match="--minutes -1.0: must be > 0"):
        main(["train-drafter", "train", "--data", str(tmp_path / "missing.pt"), "--run-dir", str(tmp_path / "r"),
              "--target", str(tmp_path / "no-such-target"), "--minutes", "-1"])


def test_responses_past_eos_run_to_max_new_tokens(tmp_path, smol_dir):
    """--past-eos: the chosen share of prompts (spread evenly) ignore EOS and run to max_new_tokens,
    with the target's EOS inside the response (the text after it is what an ignore_eos request
    asks the drafter to follow); the others end at EOS as before. A resume keeps the share."""
    from ddtree.train import generate
    prompts = tmp_path / "prompts.jsonl"
    # "Name a colour." ends at EOS after ~19 tokens at T=0 (SmolLM2-135M-Instruct)
    prompts.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "Name a colour."}]})
                                 for _ in range(4)))
    kw = dict(target=smol_dir, max_new_tokens=40, temperatures=(0.0,), device="cpu", kv_cache_gb=0.05,
              max_num_seqs=4)
    data = {}
    for share in (0.0, 0.5):
        generate.generate_responses(prompts, tmp_path / f"{share}.pt", past_eos=share, **kw)
        d = torch.load(tmp_path / f"{share}.pt")
        data[share] = [d["tokens"][a + n:b].tolist() for a, b, n in zip(d["offsets"], d["offsets"][1:], d["prompt_lens"])]
    eos = data[0.0][0][-1]
    assert all(r == data[0.0][0] and len(r) < 40 for r in data[0.0])  # all stopped at the same EOS
    lengths = [len(r) for r in data[0.5]]
    assert lengths == [len(data[0.0][0]), 40, len(data[0.0][0]), 40], lengths  # every second prompt
    assert data[0.5][1][:len(data[0.0][0])] == data[0.0][0] and eos in data[0.5][1]
    with pytest.raises(ValueError, match="past_eos 0.5, not 1.0"):
        generate.generate_responses(prompts, tmp_path / "0.5.pt", past_eos=1.0, **kw)
    generate.pack_responses(tmp_path / "0.5.pt", tmp_path / "0.5.rsp")  # the share travels with a packed pass
    generate.unpack_responses(tmp_path / "0.5.rsp", prompts, tmp_path / "again.pt", target=smol_dir)
    assert torch.load(tmp_path / "again.pt")["past_eos"] == 0.5
    with pytest.raises(ValueError, match="past_eos 0.5, not 0.0"):
        generate.generate_responses(prompts, tmp_path / "again.pt", **kw)
    old_pass = torch.load(tmp_path / "0.0.pt")
    del old_pass["past_eos"]  # a pass from before the option counts as 0
    torch.save(old_pass, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="past_eos 0.0, not 0.5"):
        generate.generate_responses(prompts, tmp_path / "old.pt", past_eos=0.5, **kw)
    with pytest.raises(ValueError, match="within"):
        generate.generate_responses(prompts, tmp_path / "bad.pt", past_eos=1.5, **kw)
