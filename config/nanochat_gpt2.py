# nanochat's GPT-2-grade run, its leaderboard's (karpathy/nanochat runs/speedrun.sh, "always the
# current state of the art": base_train --depth=24 --target-param-data-ratio=8
# --device-batch-size=16 on 8 GPUs, to beat GPT-2's CORE 0.2565): its GPT (arch='nanochat') on its
# ClimbMix shards in its own tokenizer, every other setting from its depth dial: width, heads, the
# horizon, the batch, the rates and weight decay (archs/nanochat_recipe.py; docs/nanochat.md).
# data: python data/nanochat/prepare.py --shards=170   run: python train.py config/nanochat_gpt2.py

out_dir = "out-nanochat-gpt2"
dataset = "nanochat"  # data/nanochat/shards/*.parquet and data/nanochat/tokenizer/

arch = "nanochat"
depth = 24
aspect_ratio = 64
head_dim = 128
block_size = 2048  # its max_seq_len
window_pattern = "SSSL"
bias = False
dropout = 0.0
vocab_size = 0  # the tokenizer's

# the dial: max_iters and total_batch_size 0 are its rules' (8 tokens per scaling param; the batch
# from its Power Lines rule against d12)
max_iters = 0
target_param_data_ratio = 8.0
total_batch_size = 0
batch_size = 16  # its device_batch_size

optimizer = "muonadamw"
learning_rate = 0.008  # its unembedding_lr (the head's)
embed_learning_rate = 0.3  # its embedding_lr (the value embeddings: half)
scalar_learning_rate = 0.5  # its scalar_lr
muon_learning_rate = 0.02  # its matrix_lr
weight_decay = 0.28  # Muon's cautious weight decay, before the dial scales it
grad_clip = 0.0  # base_train clips nothing
lr_schedule = "warmdown"
warmup_iters = 40
cooldown_frac = 0.65  # its warmdown_ratio
final_lr_frac = 0.05
dtype = "bfloat16"

eval_interval = 250  # its eval_every: val bits per byte
val_tokens = 41943040  # its eval_tokens, 80 x 524,288
eval_iters = 20
log_interval = 1
always_save_checkpoint = False
wandb_project = "nanochat"
wandb_run_name = "gpt2-grade-d24"
