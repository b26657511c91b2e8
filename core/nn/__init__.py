"""Model parts: attention, masks, positional encodings, layers, Transformer stacks, ViT, generation."""
