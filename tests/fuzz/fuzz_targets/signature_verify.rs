//! The module signature verifier: any bytes, against the trust store of the seed key. Only
//! the seed modules signed by that key may verify; anything else must be refused, not panic.
#![no_main]

use std::sync::OnceLock;

use attache_host::policy::signing::{self, TrustStore};
use libfuzzer_sys::fuzz_target;

fn trust() -> &'static TrustStore {
    static T: OnceLock<TrustStore> = OnceLock::new();
    T.get_or_init(|| {
        // Written by `seeds` next to the corpus; a missing key gives an empty store (all refused).
        let pk = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/keys/fuzz.pub")).unwrap_or_default();
        signing::trust(&[pk.as_slice()]).unwrap_or_default()
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = trust().verify(data) {
        assert_eq!(v.sha256, signing::sha256_hex(data), "verified hash is the module's");
        assert!(!v.signers.is_empty(), "a verified module names its signer");
    }
});
