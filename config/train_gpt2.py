# GPT-2 (124M) on FineWeb-Edu 10B tokens, build-nanogpt's recipe: 1 epoch, beats OpenAI's GPT-2 124M
# (val 3.2924 on the FineWeb-Edu val shard, HellaSwag acc_norm 0.2945). data: python fineweb.py
# (-> data/edu_fineweb10B, ~20 GB)
# run:  python train.py config/train_gpt2.py   (on every host of a pod slice / cluster:
# docs/training.md)

out_dir = "out-gpt2"
dataset = "edu_fineweb10B"
shuffle_shards = True  # a seeded shard order per epoch (in-order shards give a periodic loss)

# 2**19 = 524,288 tokens per step (~0.5M, GPT-3 small's batch), whatever the number of devices:
# gradient accumulation = total_batch_size / (batch_size * block_size * devices)
total_batch_size = 524288
# per device; lower it if it does not fit (a TPU v2-8: 16; docs/tpu.md), accumulation grows to match
batch_size = 64
block_size = 1024

n_layer = 12
n_head = 12
n_embd = 768
vocab_size = 50304  # 50257 padded to a multiple of 128
bias = True
dropout = 0.0

learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 715  # 375M tokens, as GPT-3
max_iters = 19073  # 10B tokens / 524,288 per step = 1 epoch
lr_decay_iters = 19073
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
dtype = "bfloat16"
# memory: batch 64 x 1024 per device. remat and loss_chunk are 'auto' (the defaults): the least
# recompute whose compiled step fits the device, said at start-up (`auto settings: ...`; check any
# device from a laptop with bench/train.py --memory --gpu=h100 / --topology=v5e:2x2 --preset gpt2
# --batch_size=64 --dtype=bfloat16). An 80 GB GPU takes none/0; a 16 GB v5e chip recomputes
# (docs/gpu.md, docs/tpu.md).

eval_interval = 250
eval_iters = 20  # x batch_size x devices sequences of the val shard
log_interval = 1
always_save_checkpoint = False  # save when val improves ...
checkpoint_interval = 5000  # ... every 5000 steps, and on SIGTERM/SIGINT (preemption)
hellaswag_interval = 250
hellaswag_path = ""  # "" = download the val split to the cache when online; or a local .jsonl

wandb_log = False
wandb_project = "gpt2"
wandb_run_name = "gpt2-124M-fineweb-edu"
