fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let server = std::env::var_os("CARGO_FEATURE_SERVER").is_some();
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().build_server(server).build_client(server).compile_protos(
        &["proto/attache/v1/snapshot.proto", "proto/attache/v1/responses.proto", "proto/grpc/health/v1/health.proto"],
        &["proto"],
    )?;
    Ok(())
}
