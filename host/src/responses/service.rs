//! `attache.v1.ResponsesService`: the scheduler filters' calls into the store.

use std::time::Duration;

use attache_proto::v1;
use attache_proto::v1::responses_service_server::{ResponsesService, ResponsesServiceServer};
use tonic::{Request, Response, Status};

use super::store::{NewResponse, Resolved};
use super::Responses;

#[tonic::async_trait]
impl ResponsesService for Responses {
    async fn store(&self, req: Request<v1::StoreRequest>) -> Result<Response<v1::StoreReply>, Status> {
        let r = req.into_inner();
        if r.id.is_empty() {
            return Err(Status::invalid_argument("id is required"));
        }
        let new = NewResponse {
            tenant: &r.tenant,
            id: &r.id,
            previous_id: Some(r.previous_id.as_str()).filter(|p| !p.is_empty()),
            input_items: &r.input_items,
            response: &r.response,
        };
        let reply = match Responses::store(self, &new).await {
            Ok(()) => v1::StoreReply { stored: true, reason: String::new() },
            Err(e) => v1::StoreReply { stored: false, reason: e.to_string() },
        };
        Ok(Response::new(reply))
    }

    async fn resolve(&self, req: Request<v1::ResolveRequest>) -> Result<Response<v1::ResolveReply>, Status> {
        let r = req.into_inner();
        let found = Responses::resolve(self, &r.tenant, &r.id, Duration::from_millis(u64::from(r.wait_ms))).await;
        let (outcome, items) = match found {
            Resolved::Found(items) => (v1::resolve_reply::Outcome::Found, items),
            Resolved::NotFound => (v1::resolve_reply::Outcome::NotFound, String::new()),
            Resolved::Evicted => (v1::resolve_reply::Outcome::Evicted, String::new()),
            Resolved::Unavailable => (v1::resolve_reply::Outcome::Unavailable, String::new()),
            Resolved::Pending => (v1::resolve_reply::Outcome::Pending, String::new()),
        };
        Ok(Response::new(v1::ResolveReply { outcome: outcome.into(), items }))
    }

    async fn serve(&self, req: Request<v1::ServeRequest>) -> Result<Response<v1::ServeReply>, Status> {
        let r = req.into_inner();
        let (status, body) = Responses::serve(self, &r.tenant, &r.method, &r.path).await;
        Ok(Response::new(v1::ServeReply { status: u32::from(status), body }))
    }

    async fn submit(&self, req: Request<v1::SubmitRequest>) -> Result<Response<v1::ServeReply>, Status> {
        let r = req.into_inner();
        let previous = Some(r.previous_id.as_str()).filter(|p| !p.is_empty());
        let (status, body) = Responses::submit(self, &r.tenant, previous, &r.input_items, &r.request).await;
        Ok(Response::new(v1::ServeReply { status: u32::from(status), body }))
    }
}

impl Responses {
    pub fn into_server(self) -> ResponsesServiceServer<Self> {
        ResponsesServiceServer::new(self)
    }
}
