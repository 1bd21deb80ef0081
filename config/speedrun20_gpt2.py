# modded-nanogpt's record 20 (2025-01-16, "Sub3Min": 3.2785 FineWeb val loss in 1393 steps of
# 524,288 tokens, 730M tokens, 2.99 min on 8x H100): value embeddings, U-net skips, document-causal
# block-wise long and short sliding windows growing over training, soft-capped untied FP8 head
# (arch='speedrun20'); Muon on the blocks and Adam on the head, embeddings and scalars, constant
# then cooldown (optimizer='muon20'). docs/speedrun.md. data: python data/fineweb10B/prepare.py
# --num_chunks=8 (the record's cached GPT-2 tokens) run: python train.py config/speedrun20_gpt2.py

out_dir = "out-speedrun20"
dataset = "fineweb10B"

# 8 devices x one 64K-token sequence = 524,288 tokens per step, as the record's 8 GPUs; fewer
# devices accumulate to match
total_batch_size = 524288
batch_size = 1  # sequences per device
block_size = 65536  # the record's seq_len: documents packed, split at <|endoftext|>

arch = "speedrun20"
n_layer = 12
n_head = 6  # head dim 128
n_embd = 768
vocab_size = 50257  # the embeddings' rows; the head pads to 50304
bias = False
dropout = 0.0
fp8_head = True  # the record's FP8 head in training
embed_dtype = "bfloat16"  # the record's embedding tables, stepped by Adam in bf16
window_size = 1728  # the long window grows to 1728 tokens (14 blocks of 128), the short one half

optimizer = "muon20"
learning_rate = 0.008  # Adam's, on the head
embed_learning_rate = 0.6
scalar_learning_rate = 0.04
muon_learning_rate = 0.05
muon_momentum = 0.95
muon_momentum_start = 0.85
muon_momentum_warmup = 300
muon_ns_dtype = "bfloat16"
beta1 = 0.8
beta2 = 0.95
weight_decay = 0.0
grad_clip = 0.0  # the record clips nothing
lr_schedule = "cooldown"
cooldown_frac = 0.4
max_iters = 1393
dtype = "bfloat16"
# memory: remat and loss_chunk 'auto' (the defaults): the least recompute that fits the device,
# said at start-up (docs/speedrun.md)

eval_interval = 125
eval_iters = 20  # the train split's eval batches (the record evaluates val only)
val_tokens = 10485760  # the record's fixed val set: 20 batches of 8 x 64K
log_interval = 1
always_save_checkpoint = False
checkpoint_interval = 500

wandb_log = False
wandb_project = "speedrun"
wandb_run_name = "record-20"
