//! The request parser, prefix hashing and tokenization. The body is `attache_fuzz_targets::request_parse`, which
//! `cargo xtask unit` also replays over the corpus on stable.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| attache_fuzz_targets::request_parse(data));
