"""Hugging Face checkpoints in and out of Megatron's local-spec GPTModel (`npuspeed convert`).

- hf_files: reading and writing config.json + safetensors shards, one tensor at a time
- safetensors_file / raw_io: the safetensors format, and tensor bytes moved straight between a
  file and (a view of) the parameter they belong to; host_memory: freed memory given back
- architectures: which config.json converts, and the ModelSpec it describes
- names: HF tensors <-> Megatron global parameters (fused QKV and fc1, vocabulary padding)
- deepseek: DeepSeek-V2/V3 (MLA, their routing, shared experts, dense first layers, YaRN);
  mla_core_attention: what lets the local spec build MLA
- layout: a global tensor <-> one rank's shard of a TP/PP/EP layout (the example uses it too)
- megatron_model: the whole local-spec GPTModel in one process
- megatron_args: the Megatron flags that describe a converted model
- lazy_save / dcp_regions: the checkpoint written and read one parameter (region) at a time
- into_model: a run's own model chunks filled straight from a Hugging Face directory
- hf_to_megatron / megatron_to_hf: the two directions; staging: write aside, rename at the end
- cli: `npuspeed convert ...`
"""
