//! `attache policy keygen | sign | verify`, run as the binary: exit codes and messages.

// Helpers beside the tests may unwrap too: a failing unwrap is a failing test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

use std::path::Path;
use std::process::{Command, Output};

fn attache(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_attache")).args(args).output().expect("run attache")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A minimal valid module (one exported empty function).
fn module() -> Vec<u8> {
    include_bytes!("../fixtures/minimal.wasm").to_vec()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn keygen_sign_verify_and_each_refusal() {
    let dir = std::env::temp_dir().join(format!("attache-policy-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (dir.join("a"), dir.join("b"));
    for d in [&a, &b] {
        let o = attache(&["policy", "keygen", "--out", s(d)]);
        assert!(o.status.success(), "{}", text(&o));
    }
    let plain = dir.join("scorer.wasm");
    std::fs::write(&plain, module()).unwrap();
    let signed = dir.join("scorer.signed.wasm");
    let o = attache(&["policy", "sign", "--key", s(&a.join("attache.key")), "--in", s(&plain), "--out", s(&signed)]);
    assert!(o.status.success(), "{}", text(&o));

    let verify =
        |pubkey: &Path, module: &Path| attache(&["policy", "verify", "--pubkey", s(pubkey), "--in", s(module)]);
    let o = verify(&a.join("attache.pub"), &signed);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("valid signature"), "{}", text(&o));

    let o = verify(&b.join("attache.pub"), &signed);
    assert!(!o.status.success());
    assert!(text(&o).contains("by no key in the trust store"), "{}", text(&o));

    let o = verify(&a.join("attache.pub"), &plain);
    assert!(!o.status.success());
    assert!(text(&o).contains("not signed"), "{}", text(&o));

    let mut bytes = std::fs::read(&signed).unwrap();
    let n = bytes.len();
    bytes[n - 2] ^= 0x01;
    let tampered = dir.join("tampered.wasm");
    std::fs::write(&tampered, bytes).unwrap();
    let o = verify(&a.join("attache.pub"), &tampered);
    assert!(!o.status.success());
    assert!(text(&o).contains("modified after it was signed"), "{}", text(&o));

    // keygen never overwrites a key.
    let o = attache(&["policy", "keygen", "--out", s(&a)]);
    assert!(!o.status.success(), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}
