# modded-nanogpt's record 5 (2024-10-14, "ModernArch": 3.28 FineWeb val loss in 5100 steps, 15.2 min
# on 8x H100): rotary, QK-norm, weightless RMSNorm, ReLU², zero-init projections, no position
# embedding (arch='speedrun'), Muon on the blocks' matrices and Adam on the tied embedding, a
# trapezoid schedule. docs/speedrun.md. data: python data/fineweb10B/prepare.py --num_chunks=27
# (the record's cached GPT-2 tokens, ~5.4 GB) run:  python train.py config/speedrun_gpt2.py

out_dir = "out-speedrun"
dataset = "fineweb10B"

# 8 devices x 64 x 1024 = 524,288 tokens per step, as the record's 8 GPUs; fewer devices accumulate
# to match
total_batch_size = 524288
batch_size = 64  # per device
block_size = 1024

arch = "speedrun"
n_layer = 12
n_head = 6  # head dim 128 (suggested by @Grad62304977)
n_embd = 768
vocab_size = 50304
bias = False
dropout = 0.0

optimizer = "muon"
learning_rate = 0.0036  # Adam's, on the tied embedding / head
muon_learning_rate = 0.00036  # 0.1 x learning_rate, as the record
muon_momentum = 0.95
muon_ns_dtype = "bfloat16"
# memory: remat and loss_chunk 'auto' (the defaults): the least recompute that fits the device, said
# at start-up (docs/gpu.md, docs/tpu.md)
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.0
grad_clip = 0.0  # the record clips nothing
lr_schedule = "trapezoid"
warmup_iters = 0
warmdown_iters = 1450
max_iters = 5100
dtype = "bfloat16"

eval_interval = 125
eval_iters = 20  # the train split's eval batches (the record evaluates val only)
val_tokens = 10485760  # the record's fixed val set: 20 batches of 8 x 64 x 1024
log_interval = 1
always_save_checkpoint = False
checkpoint_interval = 1000

wandb_log = False
wandb_project = "speedrun"
wandb_run_name = "record-5"
