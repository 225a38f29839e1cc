"""Stochastic Backpropagation on moving-digit clips (16 frames of 24x24, 40 classes).

Writes benchmarks/results/sbp_memory.*, sbp_stt.*, sbp_vit.* and sbp_{stt,vit}_pretrained.*:

  python benchmarks/sbp.py [--seeds 0,1,2] [--steps 800] [--train-clips 8192]
      [--learning-rate 2e-3] [--pretrain-steps 1000] [--test-clips 256]
      [--parts memory,stt-resnet8,video-vit,stt-pretrained,video-vit-pretrained]
      [--stem-suffix _1200steps]

The video transformer's accuracy that the tour and docs quote (results/
sbp_vit_pretrained_1200steps.*): ``--parts video-vit-pretrained --steps 1200 --test-clips
1024 --stem-suffix _1200steps``.

(1) compile-only memory of the StT model (per-frame ResNet-8 + temporal transformer) at
keep ratios 0.5, 0.25, 0.125 against exact, with the paper's whole-step memory model
(r Ms + Mc) / (Ms + Mc) computed from the measured exact figures; (2) accuracy and step time
of exact vs SBP r = 0.25 for the StT model and for the video transformer (first 3 of 4
blocks SBP, last exact), same seeds and steps; (3) ``*-pretrained``: the same comparison
from a spatial part pretrained on single frames, as in the paper.
"""

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from _common import RESULTS, parser, write_bench, write_report
import jmem
from jmem import bench, data, measure, models, train
from jmem.models import video


def spatial_share(batch=32, frames=16, size=24):
  """Ms / (Ms + Mc): the per-frame CNN's share of the exact step's saved bytes."""
  model = models.create_model("stt-resnet8", 40)
  x = jnp.zeros((batch, frames, size, size, 1))
  cnn = models.resnet("resnet8", model.feature_dim, norm=video.group_norm)
  params = cnn.init(jax.random.key(0), x[:1, 0])["params"]
  loss = lambda p, v: jnp.sum(cnn.apply({"params": p}, v.reshape((-1, size, size, 1))) ** 2)
  return measure.saved_residuals(loss, params, x).activation_bytes


def memory(common):
  mem = bench.run_bench(bench.BenchConfig(
      model="stt-resnet8", techniques=("sbp-0.5", "sbp-0.25", "sbp-0.125"), memory_only=True,
      **common), progress=False)
  ms = spatial_share()
  total = mem[0]["saved_bytes"]
  for r in mem:
    keep = 1.0 if r["technique"] == "exact" else float(r["technique"].split("-")[1])
    r["paper_model_ratio"] = (keep * ms + (total - ms)) / total
    r["spatial_saved_share_of_exact"] = ms / total
  write_bench(mem, "sbp_memory", meta=dict(
      note="compile-only; paper_model_ratio = (r Ms + Mc)/(Ms + Mc) with Ms the per-frame "
           "CNN's saved bytes in exact training"))
  print(json.dumps([{k: r[k] for k in ("technique", "saved_ratio", "temp_ratio",
                                       "paper_model_ratio")} for r in mem], indent=1))


def accuracy(name, common, **train):
  rows = bench.run_bench(bench.BenchConfig(model=name, techniques=("sbp-0.25",), **common,
                                           **train), progress=False)
  rows[1]["accuracy_minus_exact"] = rows[1]["accuracy"] - rows[0]["accuracy"]
  stem = {"stt-resnet8": "sbp_stt", "video-vit": "sbp_vit"}[name]
  write_bench(rows, stem, meta=dict(
      seeds=list(train["seeds"]), steps=train["steps"], train_clips=train["train_clips"],
      learning_rate=train["learning_rate"]))
  print(bench.format_table(rows))


# --parts name -> (model, results stem, learning-rate scale of the pretrained parameters)
PRETRAINED = {"stt-pretrained": ("stt-resnet8", "sbp_stt_pretrained", 0.1),
              "video-vit-pretrained": ("video-vit", "sbp_vit_pretrained", 1.0)}


def pretrained(part, seeds, steps, train_clips, learning_rate, pretrain_steps=1000,
               test_clips=256, stem_suffix=""):
  """The paper's setting: the spatial part pretrained on single frames (as the paper's
  per-frame ResNets and Video Swin were on ImageNet), then exact vs SBP r = 0.25 from the
  same weights, seeds and steps. The StT CNN is fine-tuned at 0.1x the learning rate."""
  name, stem, lr_scale = PRETRAINED[part]
  stem += stem_suffix
  clips = data.moving_digits(16, frame_size=24, digit_size=8, num_train=train_clips,
                             num_test=test_clips)
  frames = data.frames_of(clips)
  t0 = time.perf_counter()
  pre, frame_acc = video.pretrain_backbone(
      video.video_model(name, clips.num_classes), frames,
      train.TrainConfig(steps=pretrain_steps, batch_size=128, seed=0, progress=False))
  pretrain_s = time.perf_counter() - t0
  rows = []
  for keep in (1.0, 0.25):
    model = video.video_model(name, clips.num_classes)
    if keep < 1.0:           # SBP on the model's own sites, as jmem bench's sbp-<r> does
      model = jmem.convert(model, jmem.SBP(keep_ratio=keep, where=model.sbp_sites,
                                           mode=model.sbp_mode))
    accs, secs = [], []
    for seed in seeds:
      opt = train.default_optimizer(learning_rate, steps)
      if lr_scale != 1.0:
        opt = video.spatial_lr_scale(opt, lr_scale, tuple(pre))
      t0 = time.perf_counter()
      res = train.train(model, clips, train.TrainConfig(steps=steps, batch_size=32, seed=seed,
                                                        progress=False),
                        optimizer=opt, initial_params=pre)
      secs.append(time.perf_counter() - t0)
      accs.append(res.test_accuracy)
      print(f"{name} keep {keep} seed {seed}: {100 * accs[-1]:.2f}% ({secs[-1]:.0f} s)",
            flush=True)
    rows.append(dict(technique="exact" if keep == 1.0 else f"sbp-{keep}", keep_ratio=keep,
                     accuracy=statistics.mean(accs), accuracy_per_seed=accs,
                     train_seconds_per_seed=secs))
  rows[1]["accuracy_minus_exact"] = rows[1]["accuracy"] - rows[0]["accuracy"]
  meta = dict(model=name, seeds=list(seeds), steps=steps, batch_size=32,
              train_clips=train_clips, test_clips=test_clips, learning_rate=learning_rate,
              pretrained_lr_scale=lr_scale,
              pretrain=f"{', '.join(pre)} trained on one frame per training clip "
                       f"(digit labels), {pretrain_steps} steps, batch 128, seed 0; "
                       f"{pretrain_s:.0f} s; frame test accuracy {100 * frame_acc:.2f}%",
              backend=jax.default_backend())
  lines = [f"# SBP, {name} with a pretrained spatial part (the paper's setting)", ""]
  lines += [f"- {k}: {v}" for k, v in meta.items()]
  lines += ["", "| technique | test accuracy (mean) | per seed | train s / seed |",
            "|---|---:|---|---:|"]
  for r in rows:
    lines.append(f"| {r['technique']} | {100 * r['accuracy']:.2f}% | "
                 f"{', '.join(f'{100 * a:.2f}' for a in r['accuracy_per_seed'])} | "
                 f"{statistics.mean(r['train_seconds_per_seed']):.0f} |")
  lines += ["", f"SBP minus exact: {100 * rows[1]['accuracy_minus_exact']:+.2f} points."]
  write_report(stem, dict(meta=meta, rows=rows), lines)


def main():
  p = parser(__doc__)
  p.set_defaults(steps=800)
  p.add_argument("--train-clips", type=int, default=8192)
  p.add_argument("--learning-rate", type=float, default=2e-3)
  p.add_argument("--pretrain-steps", type=int, default=1000,
                 help="steps of per-frame pretraining (stt-pretrained)")
  p.add_argument("--test-clips", type=int, default=256,
                 help="held-out clips to evaluate on (*-pretrained)")
  p.add_argument("--parts", default="memory,stt-resnet8,video-vit")
  p.add_argument("--stem-suffix", default="",
                 help="appended to a *-pretrained part's results name")
  args = p.parse_args()
  common = dict(batch_size=32, image_size=24, num_frames=16)
  for part in args.parts.split(","):
    if part == "memory":
      memory(common)
    elif part in PRETRAINED:
      pretrained(part, args.seeds, args.steps, args.train_clips,
                 args.learning_rate, args.pretrain_steps, args.test_clips,
                 args.stem_suffix)
    else:
      accuracy(part, common, seeds=args.seeds, steps=args.steps,
               train_clips=args.train_clips, learning_rate=args.learning_rate)


if __name__ == "__main__":
  os.makedirs(RESULTS, exist_ok=True)
  main()
