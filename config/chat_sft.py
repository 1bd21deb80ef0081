# nanochat's supervised finetuning (its scripts/chat_sft.py): a base model trained on conversations,
# the loss on the assistant's tokens only (docs/chat.md). The base: nanochat's checkpoint directory
# or our export (python export.py --out_dir=... --format=nanochat --to=DIR); its row length, batch
# and three rates are taken from its meta as chat_sft takes them (these values are chat_sft's
# fallbacks); the rest is chat_sft's. The data: a folder of smoltalk/, mmlu/ and gsm8k/ as the
# hub publishes them (its mixture), or of train.jsonl and val.jsonl (one conversation a line).
# run: python train.py config/chat_sft.py --init_from=DIR --dataset=DIR

out_dir = "out-chat-sft"
init_from = "scratch"  # give the base model: --init_from=DIR
dataset = "chat"

arch = "nanochat"
depth = 0  # the base model's shape; no dial: chat_sft scales no rate by batch
bias = False
vocab_size = 0

max_iters = 0  # one epoch of the mixture
block_size = 2048
batch_size = 32
total_batch_size = 524288
mmlu_epochs = 3
gsm8k_epochs = 4

optimizer = "muonadamw"
lr_schedule = "sft"
learning_rate = 0.004  # its unembedding_lr fallback (base_train's default is 0.008)
embed_learning_rate = 0.3
scalar_learning_rate = 0.5
muon_learning_rate = 0.02
weight_decay = 0.0
grad_clip = 0.0
init_lr_frac = 0.8
# its --load-optimizer=1: the base's optim_*.pt (its base_train's, or our export's) warm-starts the
# optimizer: its moments and buffers, AdamW's step counts, Muon's weight decay; the rates above
load_optimizer = True
warmup_frac = 0.0
cooldown_frac = 0.5
final_lr_frac = 0.0
dtype = "bfloat16"

eval_interval = 200
val_tokens = 20971520  # its eval_tokens: 40 x 524,288
log_interval = 1
always_save_checkpoint = False
