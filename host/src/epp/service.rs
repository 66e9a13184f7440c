//! The picker's gRPC services: `envoy.service.ext_proc.v3.ExternalProcessor` (one [`Stream`]
//! per HTTP request) and `grpc.health.v1.Health` (`liveness`, `readiness`, the ext_proc service
//! name, and `""`), on the picker's listener (TLS optional), and health alone on a plaintext
//! listener for Kubernetes probes.

use std::pin::Pin;
use std::sync::Arc;

use anyhow::Context;
use attache_proto::health::health_check_response::ServingStatus;
use attache_proto::health::health_server::{Health, HealthServer};
use attache_proto::health::{HealthCheckRequest, HealthCheckResponse, HealthListRequest, HealthListResponse};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::Stream as FuturesStream;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, Instrument};

use super::picker::Picker;
use super::stream::Stream;
use super::EppConfig;

type Responses = Pin<Box<dyn FuturesStream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// The ext_proc service.
#[derive(Clone)]
pub struct Processor {
    picker: Arc<Picker>,
}

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = Responses;

    async fn process(&self, request: Request<Streaming<ProcessingRequest>>) -> Result<Response<Responses>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(32);
        let mut stream = Stream::new(self.picker.clone());
        let span = tracing::debug_span!("epp_stream");
        tokio::spawn(
            async move {
                loop {
                    let msg = match inbound.message().await {
                        Ok(Some(m)) => m,
                        Ok(None) => break,
                        Err(e) => {
                            debug!(error = %e, "gateway stream ended");
                            break;
                        }
                    };
                    for r in stream.on_message(msg).await {
                        if tx.send(Ok(r)).await.is_err() {
                            return;
                        }
                    }
                }
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// The health service: `readiness` (and the ext_proc service) serve once the picker has a
/// snapshot to plan on; `liveness` and `""` whenever the process answers.
#[derive(Clone)]
pub struct HealthService {
    picker: Arc<Picker>,
}

const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

impl HealthService {
    fn status(&self, service: &str) -> Option<ServingStatus> {
        let ready = if self.picker.synced() { ServingStatus::Serving } else { ServingStatus::NotServing };
        match service {
            "" | "liveness" => Some(ServingStatus::Serving),
            "readiness" | EXT_PROC_SERVICE => Some(ready),
            _ => None,
        }
    }
}

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(&self, request: Request<HealthCheckRequest>) -> Result<Response<HealthCheckResponse>, Status> {
        let service = request.into_inner().service;
        match self.status(&service) {
            Some(s) => Ok(Response::new(HealthCheckResponse { status: s as i32 })),
            None => Err(Status::not_found(format!("unknown service {service:?}"))),
        }
    }

    async fn list(&self, _request: Request<HealthListRequest>) -> Result<Response<HealthListResponse>, Status> {
        let statuses = ["", "liveness", "readiness", EXT_PROC_SERVICE]
            .iter()
            .filter_map(|s| Some(((*s).to_owned(), HealthCheckResponse { status: self.status(s)? as i32 })))
            .collect();
        Ok(Response::new(HealthListResponse { statuses }))
    }

    type WatchStream = Pin<Box<dyn FuturesStream<Item = Result<HealthCheckResponse, Status>> + Send>>;

    async fn watch(&self, request: Request<HealthCheckRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let service = request.into_inner().service;
        let me = self.clone();
        if me.status(&service).is_none() {
            return Err(Status::not_found(format!("unknown service {service:?}")));
        }
        // Send the status, then again whenever it changes (checked every 500 ms).
        let s = futures::stream::unfold(None, move |last| {
            let (me, service) = (me.clone(), service.clone());
            async move {
                loop {
                    let now = me.status(&service).unwrap_or(ServingStatus::ServiceUnknown);
                    if last != Some(now) {
                        return Some((Ok(HealthCheckResponse { status: now as i32 }), Some(now)));
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                }
            }
        });
        Ok(Response::new(Box::pin(s)))
    }
}

/// Bind the picker's listeners and return the future that serves them (and runs flow
/// control's clock when flow control is on).
pub async fn serve(
    cfg: &EppConfig,
    picker: Arc<Picker>,
) -> anyhow::Result<Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>>> {
    let listener =
        TcpListener::bind(cfg.listen).await.with_context(|| format!("binding the picker on {}", cfg.listen))?;
    let health = HealthServer::new(HealthService { picker: picker.clone() });
    // Windows wide enough for a 400 KB body in flight without waiting on WINDOW_UPDATEs.
    let mut server =
        Server::builder().initial_stream_window_size(Some(1 << 20)).initial_connection_window_size(Some(16 << 20));
    if let Some(tls) = &cfg.tls {
        let cert = std::fs::read(&tls.cert_file).with_context(|| format!("reading {}", tls.cert_file.display()))?;
        let key = std::fs::read(&tls.key_file).with_context(|| format!("reading {}", tls.key_file.display()))?;
        server = server.tls_config(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))?;
    }
    let processor = ExternalProcessorServer::new(Processor { picker: picker.clone() });
    let main =
        server.add_service(processor).add_service(health.clone()).serve_with_incoming(crate::tcp::no_delay(listener));
    let health_only = match cfg.health_listen {
        Some(addr) => {
            let l = TcpListener::bind(addr).await.with_context(|| format!("binding the picker's health on {addr}"))?;
            Some(Server::builder().add_service(health).serve_with_incoming(crate::tcp::no_delay(l)))
        }
        None => None,
    };
    info!(listen = %cfg.listen, tls = cfg.tls.is_some(), health = ?cfg.health_listen, "endpoint picker listening");
    let flow = picker.config().flow.enabled.then(|| {
        let p = picker.clone();
        async move {
            let mut every = tokio::time::interval(std::time::Duration::from_millis(20));
            loop {
                every.tick().await;
                p.tick();
            }
        }
    });
    if let Some(f) = flow {
        tokio::spawn(f);
    }
    Ok(Box::pin(async move {
        match health_only {
            Some(h) => tokio::try_join!(main, h).map(|_| ())?,
            None => main.await?,
        }
        Ok(())
    }))
}

#[cfg(test)]
mod tests {
    use attache_kv::KvIndex;
    use attache_policies::plugin_config::FilterConfig;
    use attache_proto::v1;
    use tokio::sync::watch;

    use super::*;
    use crate::epp::metrics::EppMetrics;

    #[tokio::test]
    async fn readiness_waits_for_a_snapshot_and_unknown_services_are_not_found() {
        let (tx, rx) = watch::channel(Arc::new(crate::push::PublishedSnapshot::default()));
        let kv = Arc::new(std::sync::Mutex::new(KvIndex::new(16)));
        let picker = Arc::new(Picker::new(FilterConfig::default(), rx, kv, Arc::new(EppMetrics::default())).unwrap());
        let h = HealthService { picker };
        let check = |service: &str| {
            let h = h.clone();
            let req = Request::new(HealthCheckRequest { service: service.into() });
            async move { h.check(req).await.map(|r| r.into_inner().status) }
        };
        assert_eq!(check("liveness").await.unwrap(), ServingStatus::Serving as i32);
        assert_eq!(check("").await.unwrap(), ServingStatus::Serving as i32);
        assert_eq!(check("readiness").await.unwrap(), ServingStatus::NotServing as i32);
        assert_eq!(check(EXT_PROC_SERVICE).await.unwrap(), ServingStatus::NotServing as i32);
        assert_eq!(check("nope").await.unwrap_err().code(), tonic::Code::NotFound);
        tx.send_replace(Arc::new(v1::Snapshot { version: 1, ..Default::default() }.into()));
        assert_eq!(check("readiness").await.unwrap(), ServingStatus::Serving as i32);
        let all = h.list(Request::new(HealthListRequest {})).await.unwrap().into_inner().statuses;
        assert_eq!(all.len(), 4);
        assert!(all.values().all(|s| s.status == ServingStatus::Serving as i32));
    }
}
