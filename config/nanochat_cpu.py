# nanochat on a CPU, as its runs/runcpu.sh trains one (base_train --depth=6 --head-dim=64
# --window-pattern=L --max-seq-len=512 --device-batch-size=32 --total-batch-size=16384
# --eval-every=100 --eval-tokens=524288 --num-iterations=5000), on the shards and tokenizer of
# python data/nanochat/prepare.py; docs/nanochat.md. run: python train.py config/nanochat_cpu.py

out_dir = "out-nanochat-cpu"
dataset = "nanochat"

arch = "nanochat"
depth = 6
head_dim = 64
window_pattern = "L"
block_size = 512
bias = False
vocab_size = 0

max_iters = 5000
total_batch_size = 16384
batch_size = 32

optimizer = "muonadamw"
learning_rate = 0.008
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

eval_interval = 100
val_tokens = 524288
eval_iters = 20
log_interval = 10
always_save_checkpoint = False
