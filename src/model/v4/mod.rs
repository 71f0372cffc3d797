//! DeepSeek-V4 (`docs/deepseek-v4.md`): its checkpoint's tensors ([`tensors`]). The graph
//! builders of its forward pass come next (issue 43); until they exist a V4 checkpoint is read,
//! checked, and refused.

pub mod forward;
pub mod tensors;
