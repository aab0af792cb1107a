//! Sums across processes for the backends without NCCL (the CPU backends,
//! wgpu, HIP): Burn's own collective engine, `burn-collective`.
//!
//! In one process the replicas of these backends sum through the host
//! ([`crate::parallel`]'s `HostExchange`: each reads its values to a host
//! vector, and the vectors are added in rank order). Across processes that
//! host sum gains one stage: the process's sum is all-reduced with the other
//! processes' over the network by `burn-collective` (one peer per process,
//! on the `NdArray` backend, since the values are on the host already), and
//! every replica continues from the run's sum. Each exchange of a step (the
//! gathered embeddings, the gradients, the step's values) crosses once.
//!
//! `burn-collective` needs a coordinator (its "global orchestrator", a
//! WebSocket service that introduces the processes to one another) and,
//! in each process, a port on which the others download its values.
//! Process 0 starts the coordinator on a free port of its own during the
//! rendezvous ([`crate::world`]) and hands the port out with it; each
//! process opens its data port on a free port of the address the
//! rendezvous reached it at. After the introduction the sums go between
//! the processes directly (a tree), without the coordinator.
//!
//! A process lost mid-run is seen by the rendezvous's links, as with NCCL;
//! `burn-collective` has no timeout of its own.

use std::net::{IpAddr, TcpListener, TcpStream};
use std::str::FromStr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn::backend::NdArray;
use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use burn_collective::{AllReduceStrategy, CollectiveConfig, PeerId, ReduceOperation};
use burn_communication::Address;

use crate::error::{Result, TrainError};
use crate::world::World;

/// The backend of the host values.
type Host = NdArray<f32>;

/// What process 0's rendezvous id says for the host engine: this marker,
/// then the coordinator's port (NCCL's ids are random bytes).
const MARKER: &[u8; 16] = b"aam-rs:burn-coll";

/// The rendezvous id that names the coordinator's `port`.
pub(crate) fn coordinator_id(port: u16) -> [u8; 128] {
    let mut id = [0u8; 128];
    id[..16].copy_from_slice(MARKER);
    id[16..18].copy_from_slice(&port.to_le_bytes());
    id
}

/// The coordinator's port in a rendezvous id, if the id is one of
/// [`coordinator_id`]'s.
pub(crate) fn coordinator_port(id: &[u8; 128]) -> Option<u16> {
    (id[..16] == MARKER[..]).then(|| u16::from_le_bytes([id[16], id[17]]))
}

/// A free TCP port on all interfaces (the OS's choice, released at once
/// for the service that binds it next).
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind(("0.0.0.0", 0))?.local_addr()?.port())
}

fn engine_error(world: &World, reason: impl std::fmt::Display) -> TrainError {
    TrainError::arg(
        "world-size",
        format!(
            "process {} of {}: burn-collective, the engine of sums across processes for \
             this backend: {reason}",
            world.rank, world.size
        ),
    )
}

/// Process 0: starts `burn-collective`'s coordinator on a free port, on a
/// thread of its own for the rest of the process, and returns the port
/// once it accepts connections.
///
/// The coordinator stops on SIGINT and SIGTERM (it installs its own
/// handlers for them, which replace SIGINT's default of ending the
/// process: a program that wants Ctrl-C to end it handles SIGINT itself).
/// The sums do not need it once the processes are introduced.
pub(crate) fn start_coordinator(world: &World) -> Result<u16> {
    let port = free_port().map_err(|e| engine_error(world, format!("a free port: {e}")))?;
    std::thread::Builder::new()
        .name("aam-collective".into())
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(burn_collective::start_global_orchestrator(port)),
                Err(e) => tracing::error!("the collective coordinator's runtime: {e}"),
            }
        })
        .map_err(|e| engine_error(world, format!("starting the coordinator: {e}")))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err(engine_error(
                world,
                format!("the coordinator did not open port {port} within 30 s"),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(port)
}

/// This process's peer in the sums across processes.
pub(crate) struct ProcessSum {
    peer: PeerId,
    rank: usize,
}

impl ProcessSum {
    /// Joins the run's processes: `coordinator` is process 0's address and
    /// the coordinator's port, `own` the address at which the others reach
    /// this process (from the rendezvous's links). Returns once every
    /// process has joined, or an error after `world.timeout`.
    pub(crate) fn join(world: &World, coordinator: (IpAddr, u16), own: IpAddr) -> Result<Self> {
        let data_port =
            free_port().map_err(|e| engine_error(world, format!("a free data port: {e}")))?;
        let address = |ip: IpAddr, port: u16| -> Result<Address> {
            let host = match ip {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            };
            Address::from_str(&format!("ws://{host}:{port}"))
                .map_err(|e| engine_error(world, format!("address {host}:{port}: {e}")))
        };
        let config = CollectiveConfig::default()
            .with_num_devices(1)
            .with_num_nodes(world.size as u32)
            .with_global_address(address(coordinator.0, coordinator.1)?)
            .with_node_address(address(own, data_port)?)
            .with_data_service_port(data_port)
            // A tree sums in a fixed order and takes tensors of any length
            // (a ring needs at least one value per process).
            .with_global_all_reduce_strategy(AllReduceStrategy::Tree(2));
        let peer = PeerId(world.rank as u32);
        // `register` returns once every process has registered; a process
        // that never comes would hold it forever.
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("aam-collective-join".into())
            .spawn(move || {
                let _ = tx.send(burn_collective::register::<Host>(
                    peer,
                    Default::default(),
                    config,
                ));
            })
            .map_err(|e| engine_error(world, format!("joining: {e}")))?;
        match rx.recv_timeout(world.timeout.max(Duration::from_secs(1))) {
            Ok(Ok(())) => Ok(Self {
                peer,
                rank: world.rank,
            }),
            Ok(Err(e)) => Err(engine_error(world, format!("joining: {e:?}"))),
            Err(_) => Err(engine_error(
                world,
                format!(
                    "the processes did not meet within {} s (coordinator {}:{}, this process \
                     at {own}:{data_port})",
                    world.timeout.as_secs(),
                    coordinator.0,
                    coordinator.1
                ),
            )),
        }
    }

    /// `values` summed over the processes (every process calls with a
    /// vector of the same length).
    pub(crate) fn sum(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        if values.is_empty() {
            return Ok(values);
        }
        let n = values.len();
        let tensor =
            Tensor::<Host, 1>::from_data(TensorData::new(values, [n]), &Default::default());
        let summed = burn_collective::all_reduce::<Host>(
            self.peer,
            tensor.into_primitive().tensor(),
            ReduceOperation::Sum,
        )
        .map_err(|e| TrainError::Replica {
            rank: self.rank,
            reason: format!(
                "a sum across processes failed (burn-collective: {e:?}): another process of \
                 the run stopped or cannot be reached (its log says why)"
            ),
        })?;
        Tensor::<Host, 1>::from_primitive(TensorPrimitive::Float(summed))
            .into_data()
            .into_vec::<f32>()
            .map_err(|e| TrainError::Replica {
                rank: self.rank,
                reason: format!("reading a sum across processes: {e:?}"),
            })
    }

    /// Leaves the collective at the run's end (closes this process's data
    /// service), waiting at most a few seconds: the coordinator may have
    /// ended with process 0 already.
    pub(crate) fn finish(&self) {
        let (peer, (tx, rx)) = (self.peer, mpsc::channel());
        let spawned = std::thread::Builder::new()
            .name("aam-collective-finish".into())
            .spawn(move || {
                let _ = tx.send(burn_collective::finish_collective::<Host>(peer));
            });
        if spawned.is_ok() {
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!("leaving the collective: {e:?}"),
                Err(_) => tracing::debug!("leaving the collective: no answer within 5 s"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_coordinator_port_travels_in_the_id() {
        assert_eq!(coordinator_port(&coordinator_id(40123)), Some(40123));
        assert_eq!(coordinator_port(&[7u8; 128]), None);
    }
}
