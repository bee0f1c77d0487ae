"""GPT pretraining: Megatron flags (``arguments``), the loop (``pretrainer``), logging (``train_logging``)."""
