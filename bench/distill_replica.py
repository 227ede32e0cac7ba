"""An in-process replica of a synchronous distillation step, for diagnosis (docs/distillation.md): the app's loss
(losses/distill.py), TrainBatch, minibatches, AdamW and gradient clipping on the HF student, the default teacher and
the cached warm start of configs/distill_tiny.yaml; `--lag 1` trains each batch one policy version late, as
`replay_buffer.max_policy_age: 1` mostly does. Held-out greedy accuracy every `--eval-every` steps.

    python -m bench.distill_replica --seed 3 --steps 40 [--lr 1e-3] [--lag 0] [--clip 0.2] [--teacher-t T]
                                    [--reward-coef 1] [--kw "tis_cap=2.0"] [--kl sampled|reverse|forward] [--top-k K]
                                    [--group G] [--minibatches M] [key=value ...]
Unset, --lr, --kl, --top-k, --group and --minibatches are configs/distill_tiny.yaml's (with its key=value overrides).
"""
import argparse, random, sys, time, torch
from apps.grpo.cli import load_job_config
from apps.grpo.launch import make_task
from apps.grpo.rollouts import warm_started_model, teacher_model, sampling_params
from apps.warm_start.supervised import greedy_accuracy
from actors.engines.hf import HFEngine
from actors.logprobs import bucket_logprobs, token_logprobs, topk_logprobs
from losses.advantages import group_advantages
from losses import distill as D
from rl.types import CompletionBatch, EpisodeBatch, TrainBatch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
p = argparse.ArgumentParser()
p.add_argument("--seed", type=int, default=0); p.add_argument("--steps", type=int, default=40)
p.add_argument("--lr", type=float, default=None); p.add_argument("--reward-coef", type=float, default=1.0)
p.add_argument("--clip", type=float, default=0.2); p.add_argument("--teacher-t", type=float, default=None)
p.add_argument("--eval-every", type=int, default=10); p.add_argument("--lag", type=int, default=0); p.add_argument("--group", type=int, default=0); p.add_argument("--kw", default="")
p.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. model_cache=DIR")
p.add_argument("--kl", default=None); p.add_argument("--top-k", type=int, default=None); p.add_argument("--minibatches", type=int, default=None)
a = p.parse_args()
cfg, _ = load_job_config(["--config", "configs/distill_tiny.yaml", f"seed={a.seed}", *a.overrides])
a.lr = cfg.trainer.lr if a.lr is None else a.lr
a.kl = cfg.trainer.loss_params.get("kl", "sampled") if a.kl is None else a.kl
a.top_k = (cfg.teacher.top_k or 100) if a.top_k is None else a.top_k
a.minibatches = cfg.trainer.minibatches if a.minibatches is None else a.minibatches
task = make_task(cfg); T = cfg.trainer.temperature; TT = a.teacher_t or T
student, _ = warm_started_model(cfg, task); teacher, _ = teacher_model(cfg, task)
torch.manual_seed(a.seed)
S = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
Tm = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
eng = HFEngine.from_model(S, HFEngine(student).tokenizer, seed=a.seed)
tok = eng.tokenizer; pad = tok.pad_token_id
opt = torch.optim.AdamW(S.parameters(), lr=a.lr, betas=(0.9, 0.999), weight_decay=0.0)
rng = random.Random(a.seed); params = sampling_params(cfg, task)
if a.group: params.n = a.group
prompts_per_step = 1024 // params.n
held = task.held_out()[:500]
kw = eval(f"dict({a.kw})"); DEBUG = kw.pop("DEBUG", 0)
def acc(): S.eval(); r = greedy_accuracy(S, tok, held, task.reward, cfg.rollout.max_tokens, task.stop_token_ids); return r
print(f"seed {a.seed} start held-out {acc():.3f} teacher held-out {greedy_accuracy(Tm, tok, held, task.reward, 4, task.stop_token_ids):.3f}", flush=True)
t0 = time.time(); queue = []
for step in range(1, a.steps + 1):
    S.eval()
    probs = task.sample_prompts(prompts_per_step, rng)
    outs = eng.generate([q.prompt for q in probs], params)
    packed = []
    for gi, (q, g) in enumerate(zip(probs, outs)):
        cb = CompletionBatch.pack([g]); r = torch.tensor([task.reward(c.text, q.answer) for c in g])
        adv, _ = group_advantages(r, torch.zeros(len(r), dtype=torch.long))
        packed.append(EpisodeBatch.from_completions(cb, episode_ids=[gi*100+i for i in range(len(g))], group_ids=[gi]*len(g), rewards=r.tolist(), advantages=adv.tolist()))
    if step <= 3 and DEBUG:
        from collections import Counter
        print(step, Counter(c.text for g in outs for c in g).most_common(8), Counter(len(c.token_ids) for g in outs for c in g))
    ep = EpisodeBatch.cat(packed)
    batch = TrainBatch.from_episodes(ep, pad)
    queue.append(batch)
    if len(queue) <= a.lag: continue
    batch = queue.pop(0)
    with torch.no_grad():
        teacher_logits = Tm(batch.input_ids[:, :-1]).logits
        batch.ref_logprobs = torch.where(batch.response_mask > 0, token_logprobs(teacher_logits, batch.input_ids[:, 1:], TT), 0)
        if a.kl != "sampled":
            batch.ref_topk_ids, batch.ref_topk_logprobs = topk_logprobs(teacher_logits, a.top_k, TT)
    old_all = None
    if "tis_cap" in kw:
        with torch.no_grad():
            S.eval(); old_all = token_logprobs(S(batch.input_ids[:, :-1]).logits, batch.input_ids[:, 1:], T)
    S.train(); ms = []
    perm = torch.randperm(batch.num_sequences)
    size = 1024 // a.minibatches
    for mb in range(a.minibatches):
        sl = batch.slice(mb*size, (mb+1)*size)
        logits = S(sl.input_ids[:, :-1]).logits
        lp = token_logprobs(logits, sl.input_ids[:, 1:], T)
        topk = None if a.kl == "sampled" else bucket_logprobs((logits.float() / T).log_softmax(-1), sl.ref_topk_ids)
        out = D.distill(lp, sl, old_logprobs=None if old_all is None else old_all[mb*size:(mb+1)*size], topk_logprobs=topk, clip_eps=a.clip, reward_coef=a.reward_coef, kl=a.kl, **kw)
        opt.zero_grad(); out.loss.backward(); gn = torch.nn.utils.clip_grad_norm_(S.parameters(), 1.0); opt.step()
        ms.append((out.metrics["reverse_kl"], gn.item(), out.metrics["clip_fraction"]))
    rew = batch.rewards.mean().item()
    line = f"step {step} revKL {ms[0][0]:.3f} reward {rew:.3f} gn {max(m[1] for m in ms):.1f} clip {sum(m[2] for m in ms)/len(ms):.3f} t {time.time()-t0:.0f}s"
    if step % a.eval_every == 0: line += f" HELD {acc():.3f}"
    print(line, flush=True)
