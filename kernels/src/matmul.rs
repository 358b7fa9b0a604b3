//! Matrix×vector and matrix×matrix products over many threads, for any weight format with [`QuantOps`].
//!
//! (under construction)
