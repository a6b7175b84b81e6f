"""`cmoe quality`: the measures (`measures`: KL, agreement, perplexity; pure) and the executor
runs that produce their inputs (`run`)."""
