"""Images in (issue 46): what a multimodal request carries from the TokenizerManager to the model.

  image_loader.py  an image part (data URL, allowed local file, URL with the flag) -> a PIL image,
                   with the size and pixel limits (MediaLimits)
  processor.py     the model's own transformers image processor, placeholder expansion, the
                   M-RoPE positions, pad_input_ids (runs in the TokenizerManager, off the loop)
  mm_inputs.py     MultimodalDataItem / MultimodalInputs (SGLang's names), hashing, pad values
  mm_cache.py      MultimodalEmbeddingCache: encoder outputs by image hash, bounded, LRU

Nothing here knows the scheduler: the front end hands a MultimodalInputs to the Req, the batch
hands each request's to the model through the ForwardBatch."""
