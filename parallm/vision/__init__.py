"""Image input for vision-language models (docs/vision.md).

- families: the model families whose images parallm serves, and what each needs (token count, features)
- fetch: image parts (data: URLs; http(s) URLs behind an allow-list) to bounded, decoded PIL images
- inputs: the tokenizer stage's side: parts -> pixel tensors and the prompt's image-token runs
- encoder / load: the engine's side: the model's vision tower, and a VLM directory loaded as a text model
  plus its encoder
- embed: the engine's prefill: features put at the image tokens' positions of a padded pass
"""
