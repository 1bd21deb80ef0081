# The speedrun recipe (config/speedrun_gpt2.py: record 5's architecture, Muon, trapezoid) at the CPU
# baby model's size and data: `make shakespeare`'s run (4 layers, 4 heads, 128 wide, block 64, batch
# 12, char-level Shakespeare), with the record's choices for the rest. Learning rates picked from a
# few tried (docs/speedrun.md), on train loss. run: python data/shakespeare_char/prepare.py &&
# python train.py config/speedrun_shakespeare_char.py

out_dir = "out-speedrun-shakespeare-char"
dataset = "shakespeare_char"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

arch = "speedrun"
n_layer = 4
n_head = 4
n_embd = 128
bias = False
dropout = 0.0

optimizer = "muon"
# as the rest of this CPU run (dtype auto: float32); the record's bf16 is for its GPUs
muon_ns_dtype = "float32"
learning_rate = 0.02  # Adam's, on the tied embedding / head
muon_learning_rate = 0.04
muon_momentum = 0.95
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.0
grad_clip = 0.0
lr_schedule = "trapezoid"
warmup_iters = 0
max_iters = 800  # the record's idea: fewer steps, then a warmdown (its 1450 of 5100, ~30%)
warmdown_iters = 240

eval_interval = 250
eval_iters = 20
log_interval = 100
always_save_checkpoint = False
