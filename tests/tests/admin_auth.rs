//! The host's admin API requires a bearer token when one is configured (every `/v1/*` route;
//! `/healthz` stays open for probes), and the host refuses to expose the admin API beyond
//! loopback without one. Runs the real host binary.

// A test crate is test code throughout, but clippy's allow-*-in-tests (clippy.toml) covers only
// #[test] functions and #[cfg(test)] modules, not the helpers beside them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::too_many_lines)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use attache_e2e::ports::free_port;
use attache_e2e::Paths;

const TOKEN: &str = "admin-token-0123456789";

fn get(port: u16, path: &str, token: Option<&str>) -> (u16, String) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let mut req = reqwest::Client::new().get(format!("http://127.0.0.1:{port}{path}"));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        match req.send().await {
            Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        }
    })
}

#[test]
fn admin_routes_need_the_token_and_exposure_needs_one() {
    let p = Paths::discover().expect("built binaries");
    let dir = p.target.join("attache-e2e").join(format!("admin-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("token"), format!("{TOKEN}\n")).expect("token");
    std::fs::write(dir.join("endpoints.yaml"), "endpoints: []\n").expect("endpoints");
    let (grpc, admin) = (free_port(), free_port());
    std::fs::write(
        dir.join("host.yaml"),
        format!(
            "grpc_listen: 127.0.0.1:{grpc}\nadmin_listen: 127.0.0.1:{admin}\nadmin_token_file: {}\nendpoints_file: {}\n",
            dir.join("token").display(),
            dir.join("endpoints.yaml").display()
        ),
    )
    .expect("config");
    let mut host = Command::new(&p.host_bin)
        .args(["host", "--config"])
        .arg(dir.join("host.yaml"))
        .env_remove("ATTACHE_ADMIN_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("host");
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(admin, "/healthz", None).0 != 200 {
        assert!(Instant::now() < deadline, "host did not answer /healthz");
        std::thread::sleep(Duration::from_millis(50));
    }
    for path in ["/v1/snapshot", "/v1/kv"] {
        let (status, body) = get(admin, path, None);
        assert_eq!(status, 401, "{path} without credentials: {body}");
        assert!(body.contains("\"unauthorized\""), "{body}");
        assert_eq!(get(admin, path, Some("wrong-token-0123456789")).0, 401, "{path} with a wrong token");
        let (status, body) = get(admin, path, Some(TOKEN));
        assert_eq!(status, 200, "{path} with the token: {body}");
    }
    let _ = host.kill();
    let _ = host.wait();

    // A non-loopback admin address without a token: the host refuses to start, and says why.
    let out = Command::new(&p.host_bin)
        .args(["host", "--endpoints"])
        .arg(dir.join("endpoints.yaml"))
        .args(["--grpc-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--admin-listen", &format!("0.0.0.0:{}", free_port())])
        .env_remove("ATTACHE_ADMIN_TOKEN")
        .output()
        .expect("host");
    assert!(!out.status.success(), "the host must refuse an unauthenticated admin API on 0.0.0.0");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("admin_token_file"), "the error names the fix: {err}");
}
