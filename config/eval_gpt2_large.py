# evaluate the base gpt2-large (loss on OpenWebText, as nanoGPT's README reports)
batch_size = 8
eval_iters = 500  # use more iterations to get good estimate
eval_only = True
wandb_log = False
init_from = "gpt2-large"
