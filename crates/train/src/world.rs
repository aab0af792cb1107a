//! Data parallel over several processes (one per node, or one per GPU):
//! where this process stands ([`World`]), and the rendezvous that starts
//! them together.
//!
//! Every process runs the same command on the same data and forms the same
//! global batches; process `p` of `P`, with `L` devices, holds the replicas
//! of global ranks `p·L .. p·L+L` of `P·L`, and each replica runs the shard
//! of its global rank ([`crate::parallel`]). The replicas sum through one
//! NCCL communicator whose ranks are all of them
//! ([`aam_models::RuntimeOps::process_group_sum`]) on CUDA, and through the
//! host and `burn-collective` on the other backends (`collective.rs`);
//! nothing else crosses processes, so the processes stay in step by doing
//! the same work.
//! Only process 0 writes checkpoints, metrics and predictions.
//!
//! **Rendezvous.** Process 0 listens on the rendezvous address's port; every
//! other process connects (retrying until the timeout: process 0 may start
//! last), says its rank, its number of replicas and a fingerprint of the run
//! (configuration, training samples, initial weights), and receives the
//! communicator's unique id, made by process 0's runtime (or the port of
//! the `burn-collective` coordinator that process 0 started). Process 0 refuses
//! a process whose rank repeats, whose device count or whose run differs,
//! and says why to it. The rendezvous
//! carries these few bytes once; the sums themselves go through NCCL.
//!
//! **A process that stops.** The rendezvous's connections stay open while
//! the run lasts ([`Links`]): when a process ends (killed, crashed, or
//! stopped by an error that only it met, such as a full disk on process 0),
//! its connections close, and the processes it was connected to (process 0
//! watches every other, each other watches process 0) learn it at once.
//! A process that completes its part says so first ([`Links::finish`]);
//! otherwise, unless the others are ending too (they met the same error
//! within a few seconds), they cannot go on: the next sum would wait
//! for the lost process forever (neither NCCL nor burn-collective has a
//! timeout), so
//! [`Links::watch`]'s caller stops the process (the trainer exits with an
//! error naming the lost process; process 0's end then stops the others).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Result, TrainError};

/// Where this process stands among the processes of a data-parallel run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    /// This process's rank, `0..size`.
    pub rank: usize,
    /// The number of processes.
    pub size: usize,
    /// `host:port` where process 0 listens (every process names the same).
    pub rendezvous: String,
    /// How long a process waits for the others at the rendezvous.
    pub timeout: Duration,
}

impl World {
    /// One process (no rendezvous).
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            rendezvous: String::new(),
            timeout: Duration::from_secs(0),
        }
    }

    /// Whether this process writes the run's files (process 0).
    pub fn writes(&self) -> bool {
        self.rank == 0
    }

    /// Checks the ranks.
    pub fn check(&self) -> Result<()> {
        if self.size == 0 || self.rank >= self.size {
            return Err(TrainError::arg(
                "rank",
                format!(
                    "{} is not a rank of a run of {} processes (ranks are 0..{})",
                    self.rank,
                    self.size,
                    self.size.saturating_sub(1)
                ),
            ));
        }
        if self.size > 1 && self.rendezvous.is_empty() {
            return Err(TrainError::arg(
                "rendezvous",
                "is needed with --world-size above 1 (host:port of process 0)",
            ));
        }
        Ok(())
    }
}

const MAGIC: &[u8; 8] = b"AAMRDV01";
/// A peer's message: magic, rank, replicas, fingerprint.
const HELLO: usize = 8 + 4 + 4 + 8;

fn rendezvous_error(world: &World, reason: impl Into<String>) -> TrainError {
    TrainError::arg(
        "rendezvous",
        format!(
            "{} (process {} of {}): {}",
            world.rendezvous,
            world.rank,
            world.size,
            reason.into()
        ),
    )
}

/// The byte a process sends on its links when its part of the run is done.
const FINISHED: u8 = 0x42;

/// This process's connections to the run's other processes (process 0: to
/// every other; the others: to process 0), open while the run lasts.
#[derive(Debug)]
pub struct Links {
    links: Vec<(usize, TcpStream)>,
    /// Set once this process needs the others no more (its last sum is
    /// done, or it is stopping): its watchers then stay quiet.
    closing: Arc<AtomicBool>,
    /// How long a watcher waits, after a linked process ended, for this
    /// process to end too (a failure that every process meets at the same
    /// step, such as a non-finite loss) before reporting the loss.
    grace: Duration,
}

impl Links {
    /// Watches each linked process on a thread of its own: `lost(rank)` runs
    /// when one ends (its link closes) before finishing its part of the run
    /// ([`Links::finish`]) while this process still needs it.
    pub fn watch(&self, lost: impl Fn(usize) + Send + Sync + 'static) -> Result<()> {
        let lost = Arc::new(lost);
        for (rank, stream) in &self.links {
            let (rank, lost, closing, grace) =
                (*rank, lost.clone(), self.closing.clone(), self.grace);
            let mut stream = stream.try_clone().map_err(|e| TrainError::Replica {
                rank,
                reason: format!("watching its link: {e}"),
            })?;
            let _ = stream.set_read_timeout(None);
            std::thread::Builder::new()
                .name(format!("aam-link-{rank}"))
                .spawn(move || {
                    // Nothing is sent on a link after the rendezvous but the
                    // end of the run: a read returns then, or when the other
                    // end closes.
                    let mut byte = [0u8; 1];
                    let finished = matches!(stream.read(&mut byte), Ok(1) if byte[0] == FINISHED);
                    if finished || closing.load(Ordering::SeqCst) {
                        return;
                    }
                    std::thread::sleep(grace);
                    if !closing.load(Ordering::SeqCst) {
                        lost(rank);
                    }
                })
                .map_err(|e| TrainError::Replica {
                    rank,
                    reason: format!("starting the thread that watches it: {e}"),
                })?;
        }
        Ok(())
    }

    /// The address at which the other processes reach this one, and
    /// process 0's (process 0: its own), as the first link saw them.
    pub fn addresses(&self) -> Option<(std::net::IpAddr, std::net::IpAddr)> {
        let (rank, stream) = self.links.first()?;
        let own = stream.local_addr().ok()?.ip();
        let process0 = if *rank == 0 {
            stream.peer_addr().ok()?.ip()
        } else {
            own
        };
        Some((own, process0))
    }

    /// Says that this process's part of the run is done (the run's last sum
    /// is): the others are told, and their ends are no longer reported.
    pub fn finish(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        for (_, stream) in &mut self.links {
            let _ = stream.write_all(&[FINISHED]);
        }
    }

    /// Closes the links while the others still need this process, as a
    /// crash would.
    #[cfg(test)]
    fn sever(mut self) {
        for (_, stream) in self.links.drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
        self.closing.store(true, Ordering::SeqCst);
    }
}

impl Drop for Links {
    /// Closes the links (without [`Links::finish`] first, the others learn
    /// that this process stopped before the run's end).
    fn drop(&mut self) {
        self.closing.store(true, Ordering::SeqCst);
        for (_, stream) in &self.links {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// Meets the other processes at `world.rendezvous`: process 0 makes the
/// communicator id with `make_id` and hands it to every other process,
/// which returns it, with the links to the other processes. `replicas`
/// (this process's) and `fingerprint` (of the run) must be the same in
/// every process.
pub fn rendezvous(
    world: &World,
    replicas: usize,
    fingerprint: u64,
    make_id: impl FnOnce() -> Result<[u8; 128]>,
) -> Result<([u8; 128], Links)> {
    world.check()?;
    let (id, links) = if world.rank == 0 {
        serve(world, replicas, fingerprint, make_id()?)?
    } else {
        join(world, replicas, fingerprint)?
    };
    Ok((
        id,
        Links {
            links,
            closing: Arc::new(AtomicBool::new(false)),
            grace: Duration::from_secs(5),
        },
    ))
}

type Linked = ([u8; 128], Vec<(usize, TcpStream)>);

fn serve(world: &World, replicas: usize, fingerprint: u64, id: [u8; 128]) -> Result<Linked> {
    let port = world
        .rendezvous
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| rendezvous_error(world, "is not host:port"))?;
    let listener = TcpListener::bind(("0.0.0.0", port))
        .map_err(|e| rendezvous_error(world, format!("listening on port {port}: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| rendezvous_error(world, e.to_string()))?;
    let deadline = Instant::now() + world.timeout;
    let mut seen = vec![false; world.size];
    seen[0] = true;
    let mut links = Vec::with_capacity(world.size - 1);
    let mut waiting = world.size - 1;
    while waiting > 0 {
        let (mut stream, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<String> = (0..world.size)
                        .filter(|&r| !seen[r])
                        .map(|r| r.to_string())
                        .collect();
                    let who = if missing.len() == 1 {
                        "process"
                    } else {
                        "processes"
                    };
                    return Err(rendezvous_error(
                        world,
                        format!(
                            "{who} {} did not come within {} s",
                            missing.join(", "),
                            world.timeout.as_secs()
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(rendezvous_error(world, e.to_string())),
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
        let mut hello = [0u8; HELLO];
        if stream.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
            // Not one of ours (a port scan, another program): ignore it.
            tracing::warn!(
                "rendezvous: ignored a connection from {peer} that is not an aam-rs process"
            );
            continue;
        }
        let rank = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes")) as usize;
        let theirs = u32::from_le_bytes(hello[12..16].try_into().expect("4 bytes")) as usize;
        let print = u64::from_le_bytes(hello[16..24].try_into().expect("8 bytes"));
        let refusal = if rank == 0 || rank >= world.size {
            Some(format!(
                "rank {rank} is not a rank of a run of {} processes",
                world.size
            ))
        } else if seen[rank] {
            Some(format!("rank {rank} came twice"))
        } else if theirs != replicas {
            Some(format!(
                "process {rank} has {theirs} devices, process 0 has {replicas} (every process needs the same number)"
            ))
        } else if print != fingerprint {
            Some(format!(
                "process {rank} runs a different configuration or data than process 0 (every process needs the same command and files)"
            ))
        } else {
            None
        };
        match refusal {
            Some(reason) => {
                let mut reply = vec![1u8];
                reply.extend(reason.as_bytes());
                let _ = stream.write_all(&reply);
                return Err(rendezvous_error(world, reason));
            }
            None => {
                let mut reply = vec![0u8];
                reply.extend(id);
                stream.write_all(&reply).map_err(|e| {
                    rendezvous_error(world, format!("answering process {rank}: {e}"))
                })?;
                seen[rank] = true;
                waiting -= 1;
                links.push((rank, stream));
            }
        }
    }
    Ok((id, links))
}

fn join(world: &World, replicas: usize, fingerprint: u64) -> Result<Linked> {
    let deadline = Instant::now() + world.timeout;
    let addresses: Vec<SocketAddr> = loop {
        // The host may not resolve yet on a fresh node: retry like a refused connection.
        match world.rendezvous.to_socket_addrs() {
            Ok(a) => break a.collect(),
            Err(e) if Instant::now() > deadline => {
                return Err(rendezvous_error(world, format!("resolving it: {e}")))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    let mut stream = loop {
        let connected = addresses
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).ok());
        match connected {
            Some(s) => break s,
            None if Instant::now() > deadline => {
                return Err(rendezvous_error(
                    world,
                    format!(
                        "process 0 did not answer within {} s",
                        world.timeout.as_secs()
                    ),
                ))
            }
            None => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    let mut hello = Vec::with_capacity(HELLO);
    hello.extend(MAGIC);
    hello.extend((world.rank as u32).to_le_bytes());
    hello.extend((replicas as u32).to_le_bytes());
    hello.extend(fingerprint.to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(|e| rendezvous_error(world, e.to_string()))?;
    // The answer: 0 and the id (the link then stays open), or 1 and why not.
    let closed = |_| rendezvous_error(world, "process 0 closed the connection");
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).map_err(closed)?;
    match status[0] {
        0 => {
            let mut id = [0u8; 128];
            stream.read_exact(&mut id).map_err(closed)?;
            Ok((id, vec![(0, stream)]))
        }
        _ => {
            let mut reason = Vec::new();
            let _ = stream.read_to_end(&mut reason);
            Err(rendezvous_error(
                world,
                format!("process 0 refused: {}", String::from_utf8_lossy(&reason)),
            ))
        }
    }
}

/// A fingerprint of bytes (FNV-1a): what every process of a run must share.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(rank: usize, size: usize, port: u16) -> World {
        World {
            rank,
            size,
            rendezvous: format!("127.0.0.1:{port}"),
            timeout: Duration::from_secs(20),
        }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Three processes (threads here) meet, the others before process 0:
    /// each ends with process 0's id.
    #[test]
    fn processes_meet_and_share_the_id() {
        let port = free_port();
        let id = [7u8; 128];
        let ids: Vec<Result<([u8; 128], Links)>> = std::thread::scope(|s| {
            let others: Vec<_> = (1..3)
                .map(|r| s.spawn(move || rendezvous(&world(r, 3, port), 2, 42, || unreachable!())))
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            let lead = rendezvous(&world(0, 3, port), 2, 42, || Ok(id));
            let mut all = vec![lead];
            all.extend(others.into_iter().map(|h| h.join().unwrap()));
            all
        });
        for got in ids {
            assert_eq!(got.unwrap().0, id);
        }
    }

    /// A process that ends while the others still need it is reported to
    /// process 0, and process 0's end to the others; a process that
    /// finished its part is not.
    #[test]
    fn a_lost_process_is_reported_and_a_finished_one_is_not() {
        use std::sync::mpsc::channel;
        let port = free_port();
        let mut links: Vec<Links> = std::thread::scope(|s| {
            let others: Vec<_> = (1..3)
                .map(|r| s.spawn(move || rendezvous(&world(r, 3, port), 1, 0, || unreachable!())))
                .collect();
            let lead = rendezvous(&world(0, 3, port), 1, 0, || Ok([1; 128]));
            let mut all = vec![lead.unwrap().1];
            all.extend(others.into_iter().map(|h| h.join().unwrap().unwrap().1));
            all
        });
        let (tx, rx) = channel();
        for (me, l) in links.iter_mut().enumerate() {
            l.grace = Duration::from_millis(300);
            let tx = tx.clone();
            l.watch(move |lost| {
                let _ = tx.send((me, lost));
            })
            .unwrap();
        }
        // Process 2 crashes: process 0 learns it (process 1 is not linked to it).
        links.pop().unwrap().sever();
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(got, (0, 2));
        // Process 1 finishes its part and ends; process 0 goes on, then ends
        // too: nobody is reported.
        let mut one = links.pop().unwrap();
        one.finish();
        drop(one);
        assert!(rx.recv_timeout(Duration::from_millis(800)).is_err());
        drop(links.pop());
        assert!(rx.recv_timeout(Duration::from_millis(800)).is_err());
        // Process 0 crashing is reported to the others.
        let port = free_port();
        let (lead, mut other) = std::thread::scope(|s| {
            let other = s.spawn(move || rendezvous(&world(1, 2, port), 1, 0, || unreachable!()));
            let lead = rendezvous(&world(0, 2, port), 1, 0, || Ok([1; 128]));
            (lead.unwrap().1, other.join().unwrap().unwrap().1)
        });
        other.grace = Duration::from_millis(100);
        let (tx, rx) = channel();
        other.watch(move |lost| tx.send(lost).unwrap()).unwrap();
        lead.sever();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 0);
    }

    /// A process of another run (fingerprint) is refused, and told why.
    #[test]
    fn a_different_run_is_refused() {
        let port = free_port();
        let (lead, other) = std::thread::scope(|s| {
            let other = s.spawn(move || rendezvous(&world(1, 2, port), 1, 1, || unreachable!()));
            let lead = rendezvous(&world(0, 2, port), 1, 2, || Ok([0; 128]));
            (lead, other.join().unwrap())
        });
        let lead = lead.unwrap_err().to_string();
        let other = other.unwrap_err().to_string();
        assert!(lead.contains("different configuration"), "{lead}");
        assert!(
            other.contains("refused") && other.contains("different configuration"),
            "{other}"
        );
    }

    /// Process 0 alone gives up after the timeout, naming who is missing.
    #[test]
    fn a_missing_process_is_named() {
        let mut w = world(0, 3, free_port());
        w.timeout = Duration::from_millis(300);
        let err = rendezvous(&w, 1, 0, || Ok([0; 128]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("processes 1, 2 did not come"), "{err}");
        let bad = World { rank: 3, ..w };
        assert!(bad.check().unwrap_err().to_string().contains("rank"));
    }
}
