# nanoGPT's CPU baby GPT (its README's command for a machine without a GPU), as a config file to
# stack after the GPU recipe: 4 layers x 4 heads x 128 wide, block 64, batch 12, 2000 iterations,
# about 2 minutes on 2 cores (docs/benchmarks.md#the-main-command). run:
# python train.py config/train_shakespeare_char.py config/cpu.py

eval_iters = 20
log_interval = 100  # nanoGPT's command logs every iteration; 2000 lines are a lot to read
block_size = 64
batch_size = 12
n_layer = 4
n_head = 4
n_embd = 128
max_iters = 2000
lr_decay_iters = 2000
dropout = 0.0
