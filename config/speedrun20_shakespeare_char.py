# modded-nanogpt's record 20 (config/speedrun20_gpt2.py: value embeddings, U-net skips, block-wise
# sliding windows, soft-capped untied head; Muon and three Adam groups, constant then cooldown) at
# the CPU baby model's size and data: 4 layers, 4 heads, 128 wide, char-level Shakespeare, with the
# record's choices for the rest but its learning rates (halved, below). Its sequences are whole
# 128-token blocks: 2 blocks of 128. run:
# python data/shakespeare_char/prepare.py && python train.py config/speedrun20_shakespeare_char.py

out_dir = "out-speedrun20-shakespeare-char"
dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 4  # sequences a step: 4 x 256 = 1024 tokens, about the baby GPT's 12 x 64 = 768
block_size = 256

arch = "speedrun20"
n_layer = 4
n_head = 4
n_embd = 128
bias = False
dropout = 0.0

optimizer = "muon20"
lr_schedule = "cooldown"
cooldown_frac = 0.4
# the record's rates (0.008, 0.6, 0.04, 0.05) scaled together by 0.5: picked from four runs on train
# loss (docs/benchmarks.md#speedrun-tokens-to-target)
learning_rate = 0.004  # Adam's on the head
embed_learning_rate = 0.3
scalar_learning_rate = 0.02
muon_learning_rate = 0.025
muon_momentum = 0.95
muon_momentum_start = 0.85
muon_momentum_warmup = 300
# as the rest of this CPU run (dtype auto: float32, and embed_dtype's float32 default); the
# record's bf16 is for its GPUs
muon_ns_dtype = "float32"
beta1 = 0.8
beta2 = 0.95
weight_decay = 0.0
grad_clip = 0.0  # the record clips nothing
max_iters = 800

eval_interval = 200
eval_iters = 20
log_interval = 100
always_save_checkpoint = False
