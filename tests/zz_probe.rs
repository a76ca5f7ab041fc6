mod common;
use quarry::engine::{EngineClient, EngineConfig, EngineCore};
use quarry::extract::{Extractor, Task};
use std::sync::Arc;
#[test]
fn probe() {
    let (backend, tok) = common::load(16384).unwrap();
    let tok = Arc::new(tok);
    let engine = EngineCore::new(Box::new(backend), tok.clone(), EngineConfig::default());
    let x = Arc::new(Extractor::new(EngineClient::start(engine), tok.clone()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let task = Task {
        logprobs: Some(5),
        ..Task::new(
            serde_json::from_str(&std::fs::read_to_string("schemas/invoice.json").unwrap()).unwrap(),
            std::fs::read_to_string("examples/documents/invoice.txt").unwrap(),
        )
    };
    let out = rt.block_on(x.run(task)).unwrap();
    for s in &out.sampled {
        let top: Vec<String> = s
            .top
            .iter()
            .map(|t| format!("{:?}:{:.2}", tok.decode(&[t.token], false).unwrap(), t.logprob))
            .collect();
        println!(
            "{:?} forced={} {:?}",
            tok.decode(&[s.token], false).unwrap(),
            s.forced,
            top
        );
    }
}
