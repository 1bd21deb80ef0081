# finetune GPT-2 on tiny shakespeare (GPT-2 BPE): python data/shakespeare/prepare.py first
out_dir = "out-shakespeare"
eval_interval = 5
eval_iters = 40
wandb_log = False  # feel free to turn on
wandb_project = "shakespeare"
wandb_run_name = "ft-gpt2"

dataset = "shakespeare"
init_from = "gpt2-xl"  # this is the largest GPT-2 model

# only save checkpoints if the validation loss improves
always_save_checkpoint = False

# the number of examples per iter:
# 1 batch_size * 32 grad_accum * 1024 tokens = 32,768 tokens/iter
# shakespeare has 301,966 tokens, so 1 epoch ~= 9.2 iters
batch_size = 1
gradient_accumulation_steps = 32
max_iters = 20

# finetune at constant LR
learning_rate = 3e-5
decay_lr = False

# memory: gpt2-xl's step at batch 1 x 1024 needs 40.5 GiB per device as a replica, 25.2 GiB with
# --fsdp=8 (XLA:CPU's analysis). remat and loss_chunk 'auto' (the defaults) recompute as little as
# fits the device, said at start-up: on a v5e-8 (16 GB chips) with --fsdp=8, check it with
# bench/train.py --memory --topology=v5e:2x4 --preset gpt2-xl --fsdp=8 --batch_size=1
# --dtype=bfloat16 (docs/tpu.md)
