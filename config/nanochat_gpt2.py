# nanochat's GPT-2-grade run, its leaderboard's (karpathy/nanochat runs/speedrun.sh, "always the
# current state of the art": base_train --depth=24 --target-param-data-ratio=8
# --device-batch-size=16 on 8 GPUs, to beat GPT-2's CORE 0.2565), after config/nanochat.py:
# its settings but these. docs/nanochat.md.
# data: python data/nanochat/prepare.py --shards=170
# run: python train.py config/nanochat.py config/nanochat_gpt2.py

out_dir = "out-nanochat-gpt2"
depth = 24
target_param_data_ratio = 8.0  # tokens per scaling param: the dial's horizon
batch_size = 16  # its device_batch_size (the batch stays its rule's: accumulation makes it up)
wandb_run_name = "gpt2-grade-d24"
