# nanochat on a 2-core CPU in minutes: its runs/runcpu.sh (base_train --depth=6 --head-dim=64
# --window-pattern=L --max-seq-len=512 --device-batch-size=32 --total-batch-size=16384
# --num-iterations=5000: 15 s a step here, 21 hours) shrunk to depth 4, 256-token rows and 4,096
# tokens a step, 200 steps (1.5 s each here); everything else its. docs/nanochat.md.
# data, offline (a minute): python data/nanochat/prepare.py --text=data/shakespeare_char/input.txt
#     --shards=4 --vocab_size=4096          (or ClimbMix's: python data/nanochat/prepare.py)
# run: python train.py config/nanochat_cpu.py

out_dir = "out-nanochat-cpu"
dataset = "nanochat"  # data/nanochat/shards/*.parquet and data/nanochat/tokenizer/

arch = "nanochat"
depth = 4
head_dim = 64  # 256 wide, 4 heads
window_pattern = "L"
block_size = 256
bias = False
vocab_size = 0  # the tokenizer's

max_iters = 200
total_batch_size = 4096
batch_size = 16

optimizer = "muonadamw"
learning_rate = 0.008  # its unembedding_lr; the dial scales the four rates by sqrt(B / 2^19)
embed_learning_rate = 0.3
scalar_learning_rate = 0.5
muon_learning_rate = 0.02
weight_decay = 0.28
grad_clip = 0.0
lr_schedule = "warmdown"
warmup_iters = 40
cooldown_frac = 0.65
final_lr_frac = 0.05
dtype = "float32"

eval_interval = 50
val_tokens = 16384
eval_iters = 4
log_interval = 10
always_save_checkpoint = False
